"""Hugging Face models as graphfp8 TransformerLayers: `g8.from_hf(model)`, `g8.to_hf(model)`.

    model = g8.from_hf(LlamaForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16).cuda())
    with g8.fp8_autocast(recipe=g8.DelayedScaling()):
        loss = g8.hf.causal_lm_loss(model(input_ids), targets)
    loss.backward()
    hf_state = g8.to_hf(model)        # Hugging Face names and layout again

Needs no import of `transformers` (the model and its config are read as they are); the optional
extra `pip install -e .[hf]` installs it.
"""

from graphfp8.hf.convert import from_hf, to_hf
from graphfp8.hf.model import CausalLM, causal_lm_loss

__all__ = ["CausalLM", "causal_lm_loss", "from_hf", "to_hf"]
