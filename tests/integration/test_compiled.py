"""The compiled decode step (enforce_eager=False) in both its forms: AOTInductor packages (engine/packaged.py, a CPU
whose weights our kernel takes) and torch.compile (engine/compiled.py: CUDA's form, and a CPU's where some weight
waits for oneDNN; forced here). Each gives the eager path's greedy tokens, writes the KV pool in place, and is made
at start-up (none while serving)."""

import asyncio
import pathlib
import re
import zipfile
from dataclasses import replace
from unittest import mock

import pytest
import torch
from conftest import make_tiny_llama, torch_threads
from parity import FAMILY_VARIANTS, make_tiny_model
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch._inductor.graph import GraphLowering
from torch.export import Dim

from liteinfer import LLM, AsyncLLM, SamplingParams, kernels
from liteinfer.engine import async_llm, llm_engine, packaged
from liteinfer.engine.compiled import CompiledDecoder
from liteinfer.engine.packaged import PackagedDecoder
from liteinfer.engine.scheduler import Scheduler
from liteinfer.layers.linear import Linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer briefly and say so when you are unsure. "
# Shared prefixes (prefix-cache hits on the second call), a one-token prompt, one longer than a prefill chunk.
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Why is the sea salty?", "Hi",
           "Tell me a joke.", SYSTEM * 6 + "Summarise."]
# 17 blocks of 16 tokens cannot hold every prompt and its 24 new tokens at once: the engine has to preempt. The odd
# count also gives a layer's pool a size (2 KV heads x 17 x 16 x 16) no other tensor of this model has.
ENGINE = dict(dtype="float32", num_kv_blocks=17, block_size=16, max_model_len=256, max_num_batched_tokens=64)


def generated_codes(fn, *args) -> list[str]:
    """The code inductor generates while `fn(*args)` runs, a graph's module each, in the order they compile. (Like
    torch's `run_and_get_code`, but without its `torch._dynamo.reset()`, which would drop a running engine's graphs:
    a compiled engine then refuses to recompile, since its weights are packed for eager steps by then.)"""
    codes = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        fn(*args)
    return codes


def generated_code(fn, *args) -> str:
    return "\n".join(generated_codes(fn, *args))


def package_code(decoder: PackagedDecoder) -> str:
    """Both packages' generated C++ and their calls of our ops (AOTInductor lists those in a JSON file)."""
    texts = []
    for one in (True, False):
        with zipfile.ZipFile(decoder.package_path(one)) as package:
            texts += [package.read(name).decode() for name in package.namelist() if name.endswith((".cpp", ".json"))]
    return "\n".join(texts)


def package_sources(package_path) -> dict[str, str]:
    """A package's generated C++ by kind: "wrapper" (the step, calling the kernels) and "kernel" (inductor's loops)."""
    with zipfile.ZipFile(package_path) as package:
        return {name.split(".")[-2]: package.read(name).decode() for name in package.namelist()
                if name.endswith((".wrapper.cpp", ".kernel.cpp"))}


def kernel_definitions(kernel_code: str) -> dict[str, tuple[str, str]]:
    """Each of inductor's kernels defined in `kernel_code`: its name -> (its parameter list, its body). (A declaration
    ends its parameters with a semicolon, which no definition's parameters hold.)"""
    return {name: (params, body) for name, params, body in
            re.findall(r"void\s+(cpp_fused_\w+)\(([^;]*?)\)\s*\{(.*?)\n\}", kernel_code, re.S)}


def loops_over_a_pool(package_path, first_pool_input: int) -> list[str]:
    """The loops in a package's kernels that run over a whole pool: loops bounded by a pool's block count (its size
    0, dynamic), which the wrapper hands a kernel among its last, integer arguments."""
    code = package_sources(package_path)
    wrapper, definitions = code["wrapper"], kernel_definitions(code["kernel"])
    inputs = re.findall(r"auto (\w+) = std::move\(inputs\[(\d+)\]\);", wrapper)
    pools = {name for name, index in inputs if int(index) >= first_pool_input}
    sizes = {symbol for symbol, name in re.findall(r"int64_t (\w+) = (\w+)_size\[0\];", wrapper) if name in pools}
    sizes |= {symbol for symbol, alias in re.findall(r"int64_t (\w+) = (\w+);", wrapper) if alias in sizes}
    loops = []
    for kernel, args in re.findall(r"\n\s*(cpp_fused_\w+)\((.*)\);", wrapper):
        integers = [arg for arg in args.split(", ") if not arg.startswith("(")]  # tensors are passed as casts
        params, body = definitions[kernel]
        for param, arg in zip(re.findall(r"const int64_t (ks\d+)", params), integers, strict=True):
            if sizes & set(re.findall(r"\w+", arg)):
                loops += [line for line in body.splitlines() if "for(" in line and param in re.findall(r"\w+", line)]
    return loops


@pytest.fixture(scope="module")
def packages(tiny_llama_dir) -> LLM:
    llm = LLM(str(tiny_llama_dir), enforce_eager=False, **ENGINE)
    if not isinstance(llm.engine.runner.compiled, PackagedDecoder):
        pytest.skip("the packages need every weight in our kernel's layout: fp32 on CPUs with AVX-512 BF16")
    return llm


def compile_forced(model_dir, patch: pytest.MonkeyPatch) -> tuple[LLM, list[str]]:
    """(torch.compile's engine of the model at `model_dir`, the code of each graph inductor generated for it at
    start-up), the form forced as if some weight waited for oneDNN."""
    patch.setattr(llm_engine, "weights_left_for_onednn", lambda model: True)
    engines = []
    codes = generated_codes(lambda: engines.append(LLM(str(model_dir), enforce_eager=False, **ENGINE)))
    assert isinstance(engines[0].engine.runner.compiled, CompiledDecoder)
    return engines[0], codes


@pytest.fixture(scope="module")
def compiled(tiny_llama_dir):
    """(torch.compile's engine, the C++/Python code inductor generated for it at start-up), as `compile_forced`."""
    with pytest.MonkeyPatch.context() as patch:
        llm, codes = compile_forced(tiny_llama_dir, patch)
    return llm, "\n".join(codes)


@pytest.fixture(scope="module")
def compiled_heads_64(tiny_heads_64, tmp_path_factory):
    """`compile_forced` of a model with heads of 64 on 2 threads, anew, in a cache of its own: inductor's caches key a
    graph on its sizes' symbols, not on their hints, and would hand back a graph traced at another example batch."""
    with pytest.MonkeyPatch.context() as patch, torch_threads(2):
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))
        return compile_forced(tiny_heads_64, patch)


@pytest.fixture(scope="module")
def eager(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), **ENGINE)


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def graph_batches(monkeypatch, decoder: type[CompiledDecoder | PackagedDecoder]) -> list[int]:
    """The batch size of each step `decoder`'s graphs run from now on (filled in as they run)."""
    batches = []
    call = decoder.__call__
    monkeypatch.setattr(decoder, "__call__", lambda self, step: batches.append(len(step.input_ids))
                        or call(self, step))
    return batches


@pytest.mark.parametrize("form", ["packages", "compiled"])
def test_compiled_decode_gives_eager_greedy_tokens(form, eager, monkeypatch, request):
    llm = request.getfixturevalue(form)
    llm = llm[0] if form == "compiled" else llm
    batches, preemptions = graph_batches(monkeypatch, type(llm.engine.runner.compiled)), []
    preempt = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, seq: preemptions.append(seq) or preempt(self, seq))

    for _ in range(2):  # the second pass finds the shared prefixes cached
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == token_ids(eager.generate(PROMPTS, GREEDY))
    one_at_a_time = [llm.generate([prompt], GREEDY)[0].outputs[0].token_ids for prompt in PROMPTS]
    assert one_at_a_time == token_ids(eager.generate(PROMPTS, GREEDY))

    assert preemptions, "the small pool was meant to force preemption"
    assert 1 in batches and max(batches) > 1  # both graphs served decode steps
    assert llm.engine.stats().prefix_cache_hit_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "phi3-long"])
def test_other_families_decode_graphs_give_the_eager_greedy_tokens(family, tmp_path, smollm2_tokenizer, monkeypatch):
    """Families with what the tiny Llama lacks trace as one graph and compute as eager does: Gemma 3 (q/k norms,
    sliding and global layers rotating at bases of their own, soft-capped logits, norms after each block) and Phi-3
    (fused q/k/v and gate/up weights, long-rope past its original context)."""
    variant = FAMILY_VARIANTS[family]
    make_tiny_model(tmp_path, smollm2_tokenizer, variant)
    options = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)
    llm, eager = LLM(str(tmp_path), enforce_eager=False, **options), LLM(str(tmp_path), **options)
    batches = graph_batches(monkeypatch, type(llm.engine.runner.compiled))
    assert token_ids(llm.generate(variant.prompts, GREEDY)) == token_ids(eager.generate(variant.prompts, GREEDY))
    assert max(batches) == len(variant.prompts)  # the batched graph served decode steps


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_packages_decode_quantized_weights_as_eager_does(method, tiny_llama_dir, monkeypatch):
    """int8 and int4 weights (their levels and scales are the model's buffers, which a package is handed by name)
    give the eager engine's tokens: in fp32 neither path depends on the batch."""
    options = dict(ENGINE, quantization=method)
    llm = LLM(str(tiny_llama_dir), enforce_eager=False, **options)
    assert isinstance(llm.engine.runner.compiled, PackagedDecoder)  # no float weight is left for oneDNN
    batches = graph_batches(monkeypatch, PackagedDecoder)
    eager = LLM(str(tiny_llama_dir), **options)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == token_ids(eager.generate(PROMPTS, GREEDY))
    assert max(batches) > 1


def serial_kernels(kernel_code: str) -> list[str]:
    """The kernels defined in `kernel_code` that run on one thread: those with no parallel region."""
    definitions = kernel_definitions(kernel_code)
    assert definitions
    return [name for name, (_, body) in definitions.items() if "#pragma omp parallel" not in body]


def test_the_batched_package_runs_each_of_its_kernels_on_every_thread(tiny_heads_64):
    """Inductor decides which of a kernel's loops run in parallel from the sizes it traced, for every batch the package
    will run: traced at too small a batch, the step's per-token kernels (the norms, the rotary with the K/V write)
    ran on one thread while the others waited (docs/benchmarks.md). Heads of 64 give each kernel a few hundred
    elements a row, enough to split at the traced batch, not at 2 rows."""
    with torch_threads(2):
        decoder = LLM(str(tiny_heads_64), enforce_eager=False, **ENGINE).engine.runner.compiled
        if not isinstance(decoder, PackagedDecoder):
            pytest.skip("the packages need every weight in our kernel's layout: fp32 on CPUs with AVX-512 BF16")
        path = decoder.package_path(False)  # (keyed on the thread count too)
    assert serial_kernels(package_sources(path)["kernel"]) == []


def test_the_batched_graph_runs_each_of_its_kernels_on_every_thread(compiled_heads_64):
    """The same of torch.compile's CPU form, whose batched graph is traced at the same example batch."""
    _, codes = compiled_heads_64
    assert len(codes) == 2
    assert serial_kernels(codes[1]) == []  # warm_up compiles the batch of one first, then the batched graph


def test_packages_are_made_at_start_up_only(packages, monkeypatch):
    assert set(packages.engine.runner.compiled.packages) == {True, False}  # batch of one, and any other batch
    monkeypatch.setattr(torch.export, "export", mock.Mock(side_effect=AssertionError("traced while serving")))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        mock.Mock(side_effect=AssertionError("compiled while serving")))
    packages.generate(PROMPTS, GREEDY)  # new batch sizes and context lengths
    packages.generate(PROMPTS[:1], GREEDY)


def test_an_engine_of_the_same_shapes_loads_the_packages_and_its_own_weights(packages, tmp_path, smollm2_tokenizer,
                                                                             monkeypatch):
    """The packages hold no weights: a second model of the same shapes starts from the first one's packages on
    disk (nothing traced or compiled), and computes with its own weights."""
    make_tiny_llama(tmp_path, smollm2_tokenizer, "gqa-untied", seed=1)
    with monkeypatch.context() as patch:
        patch.setattr(torch.export, "export", mock.Mock(side_effect=AssertionError("traced again")))
        other = LLM(str(tmp_path), enforce_eager=False, **ENGINE)
    prompts = PROMPTS[:2]
    assert token_ids(other.generate(prompts, GREEDY)) == token_ids(LLM(str(tmp_path), **ENGINE).generate(prompts,
                                                                                                        GREEDY))
    assert token_ids(other.generate(prompts, GREEDY)) != token_ids(packages.generate(prompts, GREEDY))


def test_speculative_decode_steps_run_in_the_packages(packages, eager, tiny_llama_dir, monkeypatch):
    """A decode step with drafts (several rows of one sequence, each at its own position) is a decode step: the
    packages of the same shapes run it, no new one made, with eager's tokens."""
    monkeypatch.setattr(torch.export, "export", mock.Mock(side_effect=AssertionError("traced again")))
    speculative = {"num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(tiny_llama_dir), enforce_eager=False, speculative_config=speculative, **ENGINE)
    batches = graph_batches(monkeypatch, PackagedDecoder)
    params = [GREEDY, replace(GREEDY, allowed_token_ids=list(range(300, 305)))] * 2
    prompts = PROMPTS[:4]
    assert token_ids(llm.generate(prompts, params)) == token_ids(eager.generate(prompts, params))
    assert llm.engine.stats().spec_accepted_tokens > 0
    assert max(batches) > len(prompts)  # more rows than sequences: drafts


def test_package_key_covers_what_the_generated_code_depends_on(packages, tmp_path, monkeypatch):
    """A package is found by a hash of what its code was made from: liteinfer's sources (a changed op schema must
    not meet an old package), the thread count (written into inductor's parallel loops), inductor's settings (a
    process that profiles its kernels must not leave its profiling build to the next), the batch form, the model's
    shapes."""
    decoder = packages.engine.runner.compiled
    source = tmp_path / "op.cpp"
    source.write_text("void op(int a);")
    monkeypatch.setattr(packaged, "SOURCES", tmp_path)
    keys = {decoder.package_path(True), decoder.package_path(False)}
    source.write_text("void op(int a, int b);")
    keys.add(decoder.package_path(False))
    with mock.patch.object(torch, "get_num_threads", return_value=torch.get_num_threads() + 1):
        keys.add(decoder.package_path(False))
    layer = packages.engine.runner.model.model.layers[0].mlp.down_proj
    with mock.patch.dict(layer._parameters, weight=torch.nn.Parameter(layer.weight[:-16], requires_grad=False)):
        keys.add(decoder.package_path(False))
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        keys.add(decoder.package_path(False))
    assert len(keys) == 6


def test_graphs_are_compiled_at_start_up_only(compiled):
    llm, _ = compiled
    code = llm.engine.runner.compiled._compiled._torchdynamo_orig_callable.__code__
    assert len(_debug_get_cache_entry_list(code)) == 2  # batch of one, and any other batch
    llm.generate(PROMPTS, GREEDY)
    llm.generate(PROMPTS[:1], GREEDY)
    assert len(_debug_get_cache_entry_list(code)) == 2  # new batch sizes and context lengths: no recompile


def num_linears(llm: LLM) -> int:
    """Linears a graph calls: the layers' (the LM head runs after the graph), the gate/up matmuls (the gated form,
    below) not."""
    num_layers = len(llm.engine.runner.model.model.layers)
    return sum(isinstance(m, Linear) for m in llm.engine.runner.model.modules()) - num_layers


def test_both_packages_multiply_through_the_packed_linear_kernel(packages):
    """Each package's linears run kernels/packed_linear.cpp on the model's packed weights, called from C++ (through
    AOTInductor's proxy executor), and each layer's SiLU(gate) * up runs in the gate/up matmul."""
    code = package_code(packages.engine.runner.compiled)
    num_layers = len(packages.engine.runner.model.model.layers)
    assert code.count('"target": "liteinfer::packed_linear"') == 2 * num_linears(packages)
    assert code.count('"target": "liteinfer::packed_gated_linear"') == 2 * num_layers
    assert "mkldnn" not in code and "liteinfer::gemv" not in code


def test_a_pool_of_one_block_is_traced_through_a_stand_in(packages, tmp_path, monkeypatch):
    """Export keeps a pool's block count dynamic from 2 blocks only: an engine whose pool is one block (one sequence
    of a short context) traces on a stand-in of its layout, not on the pool (export refused it before)."""
    decoder = packages.engine.runner.compiled
    monkeypatch.setattr(decoder, "pool", [tensor[:1] for tensor in decoder.pool])  # one block, the layout kept
    programs = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",  # what is traced is the question, not its code
                        lambda program, package_path, **options: programs.append(program)
                        or pathlib.Path(package_path).touch())
    decoder._compile(tmp_path / "step.pt2", one=False)
    pools = [node.meta["val"] for node in programs[0].graph.nodes if node.op == "placeholder"][-len(decoder.pool):]
    assert all(isinstance(pool.shape[0], torch.SymInt) for pool in pools)
    assert [pool.dim_order() for pool in pools] == [tensor.dim_order() for tensor in decoder.pool]


def test_packages_write_the_kv_pool_in_place(packages, tmp_path):
    """A package that functionalised the pool's update would write the whole pool back each step: a kernel loop
    over a pool's blocks, which neither package has (the K/V write takes the block count to check its indices
    only). The control, a graph that rewrites the whole of its input, shows such a loop would be found."""
    decoder = packages.engine.runner.compiled
    for one in (True, False):
        assert loops_over_a_pool(decoder.package_path(one), first_pool_input=5) == []

    class RewriteWhole(torch.nn.Module):
        def forward(self, pool):
            pool.copy_(pool * 2)
            return pool[:, :1].sum()

    program = torch.export.export(RewriteWhole(), (torch.zeros(4, 8),), dynamic_shapes=({0: Dim("blocks")},))
    control = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "rewrite.pt2"))
    assert loops_over_a_pool(control, first_pool_input=0)


def test_both_graphs_multiply_through_the_packed_linear_kernel_from_cpp(compiled):
    """Each graph's linears, LM head included, run kernels/packed_linear.cpp on the weights the engine packed before
    compiling (inductor packs no copy of its own for oneDNN), called from C++ (inductor's cpp_wrapper: no Python per
    kernel call)."""
    if not kernels.packed_linear_available(torch.float32):
        pytest.skip("the packed linear takes fp32 on CPUs with AVX-512 BF16 only")
    llm, code = compiled
    assert code.count('aoti_torch_call_dispatcher("liteinfer::packed_linear"') == 2 * num_linears(llm)
    assert "torch.ops.liteinfer.packed_linear" not in code
    assert "mkldnn" not in code and "liteinfer::gemv" not in code


def test_both_graphs_run_our_gated_activation_from_cpp(compiled):
    """Each layer's SiLU(gate) * up runs in our kernels, called from C++ as the linears are (through the boxed
    dispatcher: the ops take a string): where the packed linear takes the weights, in the gate/up matmul itself
    (`packed_gated_linear`); otherwise kernels/pointwise.cpp's op after it (its exp faster than inductor's kernel
    for the same expression)."""
    llm, code = compiled
    num_layers = len(llm.engine.runner.model.model.layers)
    fused = kernels.packed_linear_available(torch.float32)
    assert code.count('findSchemaOrThrow("liteinfer::packed_gated_linear"') == (2 * num_layers if fused else 0)
    assert code.count('findSchemaOrThrow("liteinfer::gated_activation"') == (0 if fused else 2 * num_layers)
    assert "torch.ops.liteinfer.gated_activation" not in code and "torch.ops.liteinfer.packed_gated" not in code


def test_kv_pool_is_written_in_place_not_copied(compiled):
    """A graph that functionalised the pool's update would copy the whole pool back each step: a kernel looping
    over its size. The generated code has none; the control shows such a copy would be visible."""
    llm, code = compiled
    pool_size = llm.engine.kv_cache.k[0].numel()
    assert pool_size == 2 * 17 * 16 * 16
    assert f"{pool_size}L" not in code

    def copy_whole(pool):
        pool.copy_(pool * 2)
        return pool[:, :1].sum()

    assert f"{pool_size}L" in generated_code(torch.compile(copy_whole), torch.zeros_like(llm.engine.kv_cache.k[0]))


def test_another_engine_in_the_same_process_gets_its_own_graphs(compiled, compiled_heads_64, tmp_path,
                                                                 smollm2_tokenizer):
    """Guards on the model are skipped for speed; each engine compiles a private copy of the step's code, so a
    second model never runs on the first one's frozen weights. With its weights packed for our kernel, the second
    engine's graphs come from inductor's on-disk cache (same shapes), which binds this model's weights to them: also
    after an engine of other shapes (`compiled_heads_64`) compiled in between, whose sizes dynamo would otherwise have
    made dynamic in the next engine's graphs (it counts every private copy of the code as one)."""
    make_tiny_llama(tmp_path, smollm2_tokenizer, "gqa-untied", seed=1)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "weights_left_for_onednn", lambda model: True)
        other = LLM(str(tmp_path), enforce_eager=False, **ENGINE)
    if kernels.packed_linear_available(torch.float32):  # oneDNN's packed weights cannot be pickled: no cache without it
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 2
    prompts = PROMPTS[:2]
    assert token_ids(other.generate(prompts, GREEDY)) == token_ids(LLM(str(tmp_path), **ENGINE).generate(prompts,
                                                                                                        GREEDY))
    first, _ = compiled
    assert token_ids(other.generate(prompts, GREEDY)) != token_ids(first.generate(prompts, GREEDY))


def test_async_llm_drives_the_compiled_engine_from_its_worker_thread(packages, eager, monkeypatch):
    """AsyncLLM steps the engine on a thread of its own: the packages loaded on the main thread serve it."""
    llm = packages
    monkeypatch.setattr(async_llm, "make_engine", lambda config: llm.engine)  # this engine, not a fresh compile

    async def main():
        async with AsyncLLM(str(llm.engine.config.model)) as server:
            return await asyncio.gather(server.generate(PROMPTS[:3], GREEDY), server.generate(PROMPTS[3], GREEDY))

    batched, single = asyncio.run(main())
    assert token_ids(batched + single) == token_ids(eager.generate(PROMPTS[:4], GREEDY))


def test_compile_with_tensor_parallelism_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(tiny_llama_dir), enforce_eager=False, tensor_parallel_size=2)


def test_inductor_cache_is_keyed_on_our_kernel_sources(tmp_path, monkeypatch):
    """Inductor's on-disk cache keys a graph on itself, not on the ops it calls: a graph compiled against an op's
    old schema would be reused and call it with the old arguments. The pass in the compile options carries a hash of
    our sources into the key."""
    from liteinfer.engine.compiled import _KeyedOnOurKernels

    source = tmp_path / "op.cpp"
    source.write_text("void op(int a);")
    monkeypatch.setattr(kernels, "source_files", lambda: [source])
    before = _KeyedOnOurKernels().uuid()
    source.write_text("void op(int a, int b);")
    assert _KeyedOnOurKernels().uuid() != before
