"""Hugging Face models as graphfp8 TransformerLayers: `g8.from_hf(model)`, `g8.to_hf(model)`.

    model = g8.from_hf(LlamaForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16).cuda(),
                       recipe=g8.DelayedScaling())    # carries its recipe: FP8 by itself
    loss = model(input_ids, labels=input_ids).loss    # Hugging Face's arguments and outputs
    loss.backward()
    g8.hf.save_pretrained(model, "out")               # AutoModelForCausalLM.from_pretrained("out")
    hf_state = g8.to_hf(model)                        # Hugging Face names and layout again

`import graphfp8` does not import `transformers`; from_hf's model (CausalLM, a
transformers.PreTrainedModel) does. The optional extra `pip install -e .[hf]` installs it.
"""

from graphfp8.hf.convert import from_hf
from graphfp8.hf.loss import causal_lm_loss
from graphfp8.hf.names import to_hf

__all__ = ["CausalLM", "causal_lm_loss", "from_hf", "save_pretrained", "to_hf"]


def __getattr__(name: str):
    """CausalLM and save_pretrained import transformers: loaded on first use."""
    if name == "CausalLM":
        from graphfp8.hf.model import CausalLM

        return CausalLM
    if name == "save_pretrained":
        from graphfp8.hf.checkpoints import save_pretrained

        return save_pretrained
    raise AttributeError(f"module 'graphfp8.hf' has no attribute {name!r}")
