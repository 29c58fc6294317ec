"""The demo's model and data: a tiny causal LM built from a config, and a learnable stream.

Nothing is downloaded: the model is a transformers Qwen2 built from a config
written here (about 0.43 M parameters), and the data is synthetic. Each
sequence counts up ``x[i+1] = (x[i] + a) mod vocab`` with a per-sequence
stride ``a`` drawn from a small set, so the loss falls visibly within a few
dozen steps instead of sitting at ``log(vocab)``.
"""

from __future__ import annotations

import torch

from obsckpt.demo.config import ModelSpec

# The strides a sequence may count up by.
_STRIDES = (1, 2, 3)


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


def state_crc(obj, crc: int = 0) -> int:
    """CRC32 over a nested state (dicts in key order, tensors by their bytes, DTensors by their
    local shard, other values by ``repr``): equal iff the states are bit-identical."""
    import zlib

    from obsckpt.tree import local_tensor

    obj = local_tensor(obj)
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)
        return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    if isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            crc = state_crc(obj[key], zlib.crc32(repr(key).encode(), crc))
        return crc
    if isinstance(obj, (list, tuple)):
        for item in obj:
            crc = state_crc(item, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)
