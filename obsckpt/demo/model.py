"""The demo's model and data: a tiny causal LM built from a config, and a learnable stream.

Nothing is downloaded: the model is a transformers Qwen2 built from a config
written here (about 0.43 M parameters), and the data is synthetic. Each
sequence counts up ``x[i+1] = (x[i] + a) mod vocab`` with a per-sequence
stride ``a`` drawn from a small set, so the loss falls visibly within a few
dozen steps instead of sitting at ``log(vocab)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The strides a sequence may count up by.
_STRIDES = (1, 2, 3)


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """Shape of the tiny model and of one rank's batch."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 32
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "seq_len",
            "batch_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) "
                f"and num_heads by num_kv_heads ({self.num_kv_heads})"
            )


def model_config(spec: ModelSpec):
    """A transformers ``Qwen2Config`` for ``spec`` (no hub access)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=max(256, spec.seq_len),
        # Separate input and output embeddings keep every parameter owned by one module,
        # which keeps the FSDP2 wrapping and the weight-sync name list simple.
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )


def build_model(spec: ModelSpec, *, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised causal LM; the same ``seed`` gives the same weights."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(spec))
    model.train()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def synthetic_batch(spec: ModelSpec, step: int, rank: int, *, seed: int = 0) -> torch.Tensor:
    """One rank's token batch for ``step``: deterministic in (seed, step, rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    n, length, vocab = spec.batch_size, spec.seq_len, spec.vocab_size
    strides = torch.tensor(_STRIDES, dtype=torch.long)
    stride = strides[torch.randint(len(_STRIDES), (n, 1), generator=gen)]
    start = torch.randint(vocab, (n, 1), generator=gen)
    return (start + stride * torch.arange(length)) % vocab


def fingerprint(named_tensors) -> str:
    """CRC32 over the bytes of ``(name, tensor)`` pairs in name order: equal iff bit-identical."""
    import zlib

    crc = 0
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        crc = zlib.crc32(name.encode(), crc)
        data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(data, crc)
    return f"{crc:08x}"
