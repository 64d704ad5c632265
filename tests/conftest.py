"""Shared fixtures: tiny random-weight Llama- and Qwen2-style models built in the test (no files)."""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs several workers at once (pyproject.toml): one torch thread each, for the commands the tests
    # start too, so that threads never outnumber cores (torch slows down many times over when they do)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from verispec.backends import CausalLM
from verispec.drafters import NgramDrafter

VOCAB = 97


def tiny_model(kind: str = "llama", seed: int = 0, layers: int = 4, vocab: int = VOCAB, head_dim: int = 8) -> CausalLM:
    """``head_dim`` 64 (4 heads of it) is the default model's: the one the native bfloat16 attention serves."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if kind == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":
        hf = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(kind)
    hf = hf.float().eval()
    # Sharpen the output a little so that greedy decoding has clear winners and drafts get accepted.
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(8.0)
    return CausalLM(hf, tokenizer=None, name=f"tiny-{kind}-{seed}")


def gguf_weight(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A weight as GGUF de-quantisation computes it from Q4_1 blocks, ``(d * q) + m`` in float32, or Q8_0 blocks,
    ``q * d`` (float16 d and m; in each block the quantiser gives the smallest weight q = 0 and the largest q = 15, or
    the largest magnitude q = 127)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    if kind == "q8_0":
        q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=g).float()
        q[..., 0] = 127
        return (q * d).reshape(rows, cols)
    m = (-torch.rand(rows, cols // 32, 1, generator=g) * 0.08).half().float()
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return ((d * q) + m).reshape(rows, cols)


FORWARDS = ["lean", "stock", "lean-native", "lean-bf16", "lean-bf16-native"]  # the forwards a batch can run on


def tiny_target(forward: str, head_dim: int = 8) -> CausalLM:
    """The tiny Llama on one of ``FORWARDS``: the lean forward, the transformers forward (batches run as one packed
    sequence), or the lean forward in bfloat16 on prepacked weights, as ``verispec.load(dtype=...)`` gives; or
    "lean-native" and "lean-bf16-native", the float32 and bfloat16 lean forwards with the default model's head
    dimension (64), whose attention and (in float32) linear layers run in the native kernels
    (``verispec.backends.native``; skipped where they cannot be built)."""
    from verispec.backends import native
    from verispec.backends.kernels import packing_available, use_fast_linear

    if forward == "lean-native":
        if native.attention_f32() is None or native.linear() is None:
            pytest.skip("the native float32 kernels cannot be built here (a C++ compiler, ninja, AVX2, FMA and F16C)")
        t = tiny_model("llama", head_dim=64)
        use_fast_linear(t.hf)
        return CausalLM(t.hf, None, name=t.name)
    if forward == "lean-bf16-native":
        if native.attention() is None:
            pytest.skip("the native attention kernels cannot be built here (a C++ compiler, ninja, AVX-512)")
        forward, head_dim = "lean-bf16", 64
    t = tiny_model("llama", head_dim=head_dim)
    if forward == "stock":
        return CausalLM(t.hf, None, name=t.name, lean=False)
    if forward == "lean-bf16":
        if not packing_available():
            pytest.skip("this torch or CPU has no oneDNN bfloat16 linear")
        use_fast_linear(t.hf.bfloat16())
        return CausalLM(t.hf, None, name=t.name)
    return t


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request) -> CausalLM:
    return tiny_model(request.param)


class ByteTokenizer:
    """Enough of a tokenizer for the tiny random models: bytes folded into the vocabulary."""

    chat_template = None
    bos_token_id = 1

    def __init__(self, vocab):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + b % (self.vocab - 3) for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


class Contrarian(NgramDrafter):
    """A draft that is always wrong: it proposes only token 0 (a law with all its mass there), never the tiny
    model's choice under top_k = 1 on the prompts of the tests that use it."""

    def _root_logits(self, context):
        out = torch.full((self.vocab_size,), float("-inf"))
        out[0] = 0.0
        return out

    def _node_logits(self, g, nodes):
        return torch.stack([self._root_logits(None) for _ in nodes])


class Utf8Tokenizer:
    """Bytes as tokens (id = byte + 3, so the tiny model's vocabulary needs 259 ids), decoded as UTF-8 with
    replacement: a character of several bytes spans several tokens, as under byte-level BPE. Its chat template
    marks each role."""

    chat_template = "<role>content"
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + b for b in text.encode()]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                              else "")

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


def tiny_text_model(seed: int = 0) -> CausalLM:
    """A tiny random model that reads and writes text (``Utf8Tokenizer``)."""
    target = tiny_model("llama", seed=seed, layers=2, vocab=259)
    target.tokenizer = Utf8Tokenizer()
    return target
