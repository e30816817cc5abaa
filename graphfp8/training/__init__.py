"""The pieces of the main job (`graphfp8-train`): corpus, GPT model, training loop, reports."""
