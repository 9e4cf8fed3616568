"""The `liteinfer` command line, run in-process against a tiny random Llama."""

import io
import json
import shutil
import socket

import pytest

from liteinfer import LLM, SamplingParams
from liteinfer.entrypoints.cli import DEMO_PROMPTS, main
from liteinfer.entrypoints.openai import server

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def model_args(tiny_llama_dir):
    # Greedy and short: the answers are deterministic, so they can be checked against `LLM` itself.
    return ["--model", str(tiny_llama_dir), "--dtype", "float32", "--temperature", "0", "--max-tokens", "6"]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """prompt -> the greedy answer `LLM.generate` gives, what the CLI must print."""
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    return {prompt: output.outputs[0].text for prompt, output in zip(PROMPTS, outputs, strict=True)}


def run_json(capsys, *argv) -> list[dict]:
    assert main(["generate", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_one_prompt(capsys, model_args, expected):
    assert main(["generate", PROMPTS[0], *model_args]) == 0
    assert capsys.readouterr().out == expected[PROMPTS[0]] + "\n"


def test_generate_several_prompts_are_separated(capsys, model_args, expected):
    assert main(["generate", *PROMPTS, *model_args]) == 0
    out = capsys.readouterr().out
    assert out.index("=== [1/2] The capital of France is ===") < out.index("=== [2/2] Once upon a time ===")
    for prompt in PROMPTS:
        assert expected[prompt] in out


def test_json_has_every_field_with_the_right_types(capsys, model_args, expected):
    records = run_json(capsys, *PROMPTS, *model_args)
    assert [r["prompt"] for r in records] == PROMPTS
    for record in records:
        assert record["text"] == expected[record["prompt"]]
        assert isinstance(record["token_ids"], list) and all(isinstance(t, int) for t in record["token_ids"])
        assert record["num_output_tokens"] == len(record["token_ids"])
        assert 1 <= record["num_output_tokens"] <= 6
        assert record["finish_reason"] in ("stop", "length")
        if record["finish_reason"] == "length":
            assert record["num_output_tokens"] == 6
        assert isinstance(record["num_prompt_tokens"], int) and record["num_prompt_tokens"] >= 1
        assert record["error"] is None


def test_prompts_from_file_skip_blank_lines(capsys, tmp_path, model_args):
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n", encoding="utf-8")
    records = run_json(capsys, "--file", str(prompt_file), *model_args)
    assert [r["prompt"] for r in records] == PROMPTS


def test_prompts_from_piped_stdin(capsys, monkeypatch, model_args):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(PROMPTS) + "\n"))
    records = run_json(capsys, *model_args)
    assert [r["prompt"] for r in records] == PROMPTS


def test_dash_reads_stdin_among_other_prompts(capsys, monkeypatch, model_args):
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPTS[1]))
    records = run_json(capsys, PROMPTS[0], "-", *model_args)
    assert [r["prompt"] for r in records] == PROMPTS


def test_chat_applies_the_chat_template(capsys, tiny_llama_dir, model_args):
    records = run_json(capsys, "--chat", PROMPTS[0], *model_args)
    tokenizer = LLM(str(tiny_llama_dir), dtype="float32").tokenizer
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    assert records[0]["prompt"] == PROMPTS[0]
    assert records[0]["num_prompt_tokens"] == len(tokenizer.encode(template, add_special_tokens=False))
    assert records[0]["num_prompt_tokens"] > len(tokenizer.encode(PROMPTS[0]))


@pytest.mark.parametrize(
    "bad_args, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        (["--kv-cache-dtype", "int8", "--device", "cuda"], "kv_cache_dtype int8 runs on CPU"),
        (["--revision", "v1"], "revision='v1' picks a version of a Hub model"),  # the model is a local directory
        (["--tokenizer", "/no/such/tokenizer"], "tokenizer path not found: /no/such/tokenizer"),
        (["--speculative-config", "{num_speculative_tokens: 2}"], "--speculative-config: not JSON"),
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "method must be 'ngram'"),
    ],
)
def test_invalid_values_exit_2_with_the_message(capsys, model_args, bad_args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", *model_args, *bad_args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_serve_refuses_an_address_it_cannot_take_before_loading_the_model(capsys, monkeypatch, tiny_llama_dir):
    """As vLLM: a port out of range or in use is an error in a moment, not after the model has loaded."""
    monkeypatch.setattr(server, "AsyncLLM", lambda *args, **options: pytest.fail("the model should not load"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for bad_port, message in ((70000, "a port is a number in 0-65535"),
                                  (port, f"cannot listen on 127.0.0.1:{port}: Address already in use")):
            with pytest.raises(SystemExit) as exit_info:
                main(["serve", "--model", str(tiny_llama_dir), "--port", str(bad_port)])
            assert exit_info.value.code == 2
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err


def test_missing_prompt_file_exits_2(capsys, tmp_path, model_args):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--file", str(tmp_path / "missing.txt"), *model_args])
    assert exit_info.value.code == 2
    assert "missing.txt" in capsys.readouterr().err


def test_models_lists_llama(capsys):
    assert main(["models"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out.splitlines()


def test_demo_prints_answers_and_throughput(capsys, tiny_llama_dir):
    assert main(["demo", "--model", str(tiny_llama_dir), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Loaded {tiny_llama_dir} (bfloat16) in ")
    for i, prompt in enumerate(DEMO_PROMPTS, 1):
        assert f"[{i}] Q: {prompt}" in out
    throughput = out.strip().splitlines()[-1]
    assert throughput.startswith(f"{len(DEMO_PROMPTS)} requests, ")
    assert throughput.endswith(" output tok/s")


def test_generate_samples_as_the_model_recommends_where_its_flags_are_unset(capsys, monkeypatch, tiny_llama_dir,
                                                                            tmp_path):
    """The sampling flags left out take the model's generation_config.json (as vLLM's requests do); the ones given,
    and --max-tokens, win; `--generation-config vllm` leaves the file out."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, directory)
    generation_config = json.loads((directory / "generation_config.json").read_text())
    generation_config.update(do_sample=True, temperature=0.6, top_k=20)
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
    used = []
    generate = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params, **options: (
        used.append(params), generate(self, prompts, params, **options))[1])
    for more in ([], ["--top-k", "5"], ["--generation-config", "vllm"]):
        assert main(["generate", "hi", "--model", str(directory), "--max-tokens", "3", *more]) == 0
    capsys.readouterr()
    assert [(p.temperature, p.top_k, p.max_tokens) for p in used] == [(0.6, 20, 3), (0.6, 5, 3), (1.0, 0, 3)]


def test_speculative_decoding_from_the_command_line_gives_the_plain_answers(capsys, model_args, expected):
    records = run_json(capsys, *PROMPTS, *model_args, "--speculative-config", '{"num_speculative_tokens": 2}')
    assert [record["text"] for record in records] == [expected[prompt] for prompt in PROMPTS]


@pytest.mark.parametrize("flags", [["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]])
def test_serve_takes_auto_tool_choice_and_its_parser_together(capsys, tiny_llama_dir, flags):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(tiny_llama_dir), *flags])
    assert exit_info.value.code == 2
    assert "--enable-auto-tool-choice and --tool-call-parser go together" in capsys.readouterr().err
