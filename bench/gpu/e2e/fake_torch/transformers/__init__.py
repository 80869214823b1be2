"""A stand-in for the parts of HuggingFace transformers that tools/gpu/hf_workloads.py's train
mode uses, on the shape-only fake torch next to it (see torch/__init__.py): a Llama-style causal
LM whose forward pass takes input_ids (memory is modelled by torch.randint, as for the GPT) and
returns a loss. It checks hf_workloads.py's control flow and JSON result, not numerics.
"""
import types

import torch

__version__ = "0.0-fake"


class LlamaConfig:
    def __init__(self, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, vocab_size=32000,
                 max_position_embeddings=2048, **kwargs):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        for k, v in kwargs.items():
            setattr(self, k, v)


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, config):
        self.config = config
        d = config.hidden_size
        kv = d // config.num_attention_heads * config.num_key_value_heads
        self.embed = torch.nn.Embedding(config.vocab_size, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleList([torch.nn.Linear(d, d + 2 * kv), torch.nn.Linear(d, d),
                                 torch.nn.Linear(d, 2 * config.intermediate_size),
                                 torch.nn.Linear(config.intermediate_size, d)])
            for _ in range(config.num_hidden_layers))
        self.lm_head = torch.nn.Linear(d, config.vocab_size, bias=False)

    def forward(self, input_ids=None, labels=None, attention_mask=None):
        b, t = input_ids.shape
        if t > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {t} above max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        logits = torch.Tensor((b, t, self.config.vocab_size))
        loss = torch.Tensor(()) if labels is not None else None
        return types.SimpleNamespace(loss=loss, logits=logits)
