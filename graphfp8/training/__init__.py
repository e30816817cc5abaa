"""The pieces of the main job (`graphfp8-train`): data, GPT model, training loop, validation,
checkpoints, reports."""
