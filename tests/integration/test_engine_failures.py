"""A request that fails mid-generation ends alone: the others in its batch finish unharmed."""

from liteinfer import LLM, SamplingParams


def test_engine_failing_request_is_aborted_and_others_finish(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "Bees make honey by"]
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]

    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)

    def broken_step(token_ids):
        raise RuntimeError("detokenizer exploded")

    engine.requests["r1"].seqs[0].detokenizer.step = broken_step
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out

    assert finished["r1"].outputs[0].finish_reason == "abort"
    assert "detokenizer exploded" in finished["r1"].error
    for i in (0, 2):
        assert finished[f"r{i}"].error is None
        assert finished[f"r{i}"].outputs[0].token_ids == expected[i]
        assert finished[f"r{i}"].outputs[0].finish_reason == "length"
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks and not any(manager.ref_counts)
