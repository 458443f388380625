"""The serving benchmark's pure-Python parts (benchmarks/serve/): model directory, methods, log and result parsing, report."""

import json
import os
import random
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "serve"))

import bench_serve  # noqa: E402
import methods  # noqa: E402
import model_dir  # noqa: E402
import records  # noqa: E402
import report  # noqa: E402
import vllm_server  # noqa: E402


def test_qwen3_30b_a3b_directory_has_the_design_shape_and_no_weights(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    d = model_dir.write("qwen3-30b-a3b", str(tmp_path / "m"))
    assert not [f for f in os.listdir(d) if f.endswith((".safetensors", ".bin"))]
    c = AutoConfig.from_pretrained(d)
    assert c.architectures == ["Qwen3MoeForCausalLM"] and c.model_type == "qwen3_moe"
    assert (c.hidden_size, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok) == (2048, 48, 128, 8)
    assert (c.moe_intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (768, 32, 4, 128)
    assert c.vocab_size == 151936 and not c.tie_word_embeddings and c.mlp_only_layers == []
    assert getattr(c, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.vocab_size == c.vocab_size and tok.eos_token_id == c.eos_token_id == c.vocab_size - 1


def test_tokenizer_decodes_every_id_the_model_can_emit_at_once():
    """The server's incremental detokenizer must emit each generated token as text; with a token that decodes to
    no complete character it decodes the whole prompt again at every step (host time x prompt length x batch)."""
    import tokenizers

    tok = model_dir.text_tokenizer()
    g = random.Random(0)
    prompt = [g.randrange(94) for _ in range(512)]
    text = tok.decode(prompt)
    assert len(text) == 512 and text.isascii() and text.isprintable() and tok.encode(text) == prompt
    stream = tokenizers.decoders.DecodeStream(ids=prompt, skip_special_tokens=True)
    for i in [94, 95 + 94 * 94, model_dir.EOS_TOKEN_ID - 1] + [g.randrange(model_dir.EOS_TOKEN_ID) for _ in range(200)]:
        piece = stream.step(tok._tokenizer, i)
        assert piece == tok.decode([i]) and 1 <= len(piece) <= 3 and piece.isprintable(), (i, piece)


def test_gptq_directory_quantizes_attention_and_experts(tmp_path):
    d = model_dir.write("tiny", str(tmp_path / "g"), model_dir.GPTQ_INT4)
    with open(os.path.join(d, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == ("gptq", 4, 128, False, True)
    assert "self_attn.o_proj" in qc["modules_in_block_to_quantize"]


def test_methods():
    assert [m.name for m in methods.parse_methods("all")] == ["bf16", "gptq-int4", "kbit-2", "kbit-3", "kbit-4", "kbit-5"]
    k3 = methods.parse_methods("kbit-3")[0]
    i = k3.serve_args.index("--hf-overrides")
    assert json.loads(k3.serve_args[i + 1]) == {"quantization_config": {"quant_method": "kbit", "bits": 3}}
    assert dict(k3.llm_kwargs)["quantization"] == "kbit" and k3.bits == 3
    with pytest.raises(ValueError, match="unknown method"):
        methods.parse_methods("bf16,int3")
    rot = methods.parse_methods("kbit-4-rot")[0]
    qc = json.loads(rot.serve_args[rot.serve_args.index("--hf-overrides") + 1])["quantization_config"]
    assert qc == {"quant_method": "kbit", "bits": 4, "rotation": {"seed": 0}} and rot.bits == 4
    from vllm_kbit.settings import KbitSettings  # the plugin reads it as an online rotation

    assert KbitSettings.from_dict(qc).rotation.seed == 0


def test_log_facts_reads_both_gpu_runners_and_the_kv_cache_lines():
    log = (
        "(EngineCore pid=1) INFO [gpu_model_runner.py:5348] Model loading took 56.91 GiB memory and 12.5 seconds\n"
        "(EngineCore pid=1) INFO [gpu_worker.py:561] Available KV cache memory: 12.4 GiB\n"
        "(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: 135,456 tokens\n"
    )
    assert vllm_server.log_facts(log) == {"weight_gib": 56.91, "kv_cache_gib": 12.4, "kv_cache_tokens": 135456}
    assert vllm_server.log_facts("Model loading took 16.2 GiB and 3.1 seconds")["weight_gib"] == 16.2
    assert vllm_server.log_facts("nothing") == {"weight_gib": None, "kv_cache_gib": None, "kv_cache_tokens": None}


def test_log_facts_of_a_tensor_parallel_server_are_per_gpu():
    log = (
        "(Worker_TP1 pid=12) INFO [gpu_model_runner.py:5348] Model loading took 28.47 GiB memory and 9.1 seconds\n"
        "(Worker_TP0 pid=11) INFO [gpu_model_runner.py:5348] Model loading took 28.49 GiB memory and 9.0 seconds\n"
        "(Worker_TP0 pid=11) INFO [gpu_worker.py:561] Available KV cache memory: 95.1 GiB\n"
        "(Worker_TP1 pid=12) INFO [gpu_worker.py:561] Available KV cache memory: 95.3 GiB\n"
        "(EngineCore pid=10) INFO [kv_cache_utils.py:2177] GPU KV cache size: 2,077,184 tokens\n"
    )
    assert vllm_server.log_facts(log) == {"weight_gib": 28.49, "weight_gib_per_rank": [28.47, 28.49], "kv_cache_gib": 95.3,
                                          "kv_cache_tokens": 2077184}


def test_tp_goes_to_vllm_serve_the_file_name_and_the_records(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_serve, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(bench_serve, "commit", lambda: "abc")
    args = ["--tp", "2", "--methods", "kbit-4", "--out", str(tmp_path), "--work", str(tmp_path / "w")]
    monkeypatch.setattr(sys, "argv", ["bench_serve.py", *args])
    captured = {}
    monkeypatch.setattr(bench_serve.Run, "run", lambda self: captured.update(run=self))
    bench_serve.main()
    run = captured["run"]
    method = methods.parse_methods("kbit-4")[0]
    serve = run.serve_args(method)
    assert serve[serve.index("--tensor-parallel-size") + 1] == "2"
    assert os.path.basename(run.stem).startswith("serve_tp2_NVIDIA_H200_")
    ctx = run.context(method, "m", (1024, 256, 4), 16, {}, "cmd")
    assert ctx["tp"] == 2 and ctx["model"].endswith("TP=2")
    path = str(tmp_path / "r.jsonl")
    records.append(path, records.from_bench(_bench(200.0, 64, 64 * 256), ctx))
    assert bench_serve.done_steps([path], "abc", tp=2) == {("kbit-4", 1024, 256, 16)}
    assert bench_serve.done_steps([path], "abc") == set()  # a TP=1 run does not skip TP=2 results
    assert "| kbit-4 | 4 | 2 |" in report.markdown(records.load([path]))
    monkeypatch.setattr(sys, "argv", ["bench_serve.py", "--methods", "kbit-4", "--out", str(tmp_path), "--work", str(tmp_path / "w")])
    bench_serve.main()
    assert "--tensor-parallel-size" not in captured["run"].serve_args(method)
    assert os.path.basename(captured["run"].stem).startswith("serve_NVIDIA_H200_")


def test_lora_rank_serves_every_method_with_one_adapter_and_ratios_against_gptq_with_it(tmp_path, monkeypatch):
    """--lora-rank 8: one random rank-8 adapter on q/k/v/o_proj (shapes from the model's config.json) served by every
    method and used by every request; the records call the methods <method>+lora8, and the report puts them beside
    GPTQ int4 with the same adapter."""
    import json

    from safetensors import safe_open

    monkeypatch.setattr(bench_serve, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(bench_serve, "commit", lambda: "abc")
    work = tmp_path / "w"
    monkeypatch.setattr(sys, "argv", ["bench_serve.py", "--shape", "tiny", "--methods", "kbit-4,gptq-int4",
                                      "--lora-rank", "8", "--out", str(tmp_path), "--work", str(work)])
    served = []
    monkeypatch.setattr(bench_serve.Run, "method", lambda self, m, model: served.append((m, self.serve_args(m),
                                                                                        list(self.bench_extra))))
    monkeypatch.setattr(bench_serve.bench_client.BenchClient, "start", lambda self: None)
    monkeypatch.setattr(bench_serve.bench_client.BenchClient, "close", lambda self: None)
    bench_serve.main()
    assert [m.name for m, _, _ in served] == ["kbit-4+lora8", "gptq-int4+lora8"]
    adapter = str(work / "lora-r8")
    for m, serve, bench in served:
        assert serve[serve.index("--lora-modules") + 1] == f"adapter={adapter}" and "--enable-lora" in serve
        assert serve[serve.index("--max-lora-rank") + 1] == "8" and bench == ["--lora-modules", "adapter"]
    assert "--quantization" in served[0][1]  # the method's own arguments stay
    config = json.load(open(work / "tiny-plain" / "config.json"))
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as f:
        q_a = f.get_tensor("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight")
        o_b = f.get_tensor("base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight")
    assert q_a.shape == (8, config["hidden_size"]) and o_b.shape == (config["hidden_size"], 8)
    path = str(tmp_path / "r.jsonl")
    for method, tok_s in (("gptq-int4+lora8", 100.0), ("kbit-4+lora8", 130.0)):
        records.append(path, records.from_bench(_bench(tok_s, 64, 64 * 256), _context(method, 16)))
    md = report.markdown(records.load([path]))
    assert "Output tok/s relative to gptq-int4+lora8:" in md and "| kbit-4+lora8 | 1.30x |" in md


def _context(method, c, bits=4):
    return {"gpu": "H100", "commit": "abc", "date": "2026-11-23 10:00 UTC", "model": "m", "method": method, "bits": bits,
            "concurrency": c, "input_len": 1024, "output_len": 256, "num_prompts": max(8, 4 * c),
            "weight_gib": 16.0, "kv_cache_gib": 50.0, "kv_cache_tokens": 500000, "startup_s": 90.0, "command": "vllm serve"}


def _bench(tok_s, prompts, out_tokens, failed=0):
    return {"output_throughput": tok_s, "mean_tpot_ms": 5.0, "mean_ttft_ms": 40.0, "median_tpot_ms": 5.0,
            "p99_tpot_ms": 6.0, "median_ttft_ms": 39.0, "num_prompts": prompts, "completed": prompts - failed,
            "failed": failed, "total_output_tokens": out_tokens, "duration": 10.0}


def test_records_from_bench_flags_failed_requests_and_short_outputs():
    ok = records.from_bench(_bench(200.0, 8, 8 * 256), _context("kbit-4", 1))
    assert ok["output_tok_s"] == 200.0 and ok["tpot_ms"] == 5.0 and ok["ttft_ms"] == 40.0 and ok["error"] is None
    assert ok["weight_gib"] == 16.0 and ok["kv_cache_tokens"] == 500000
    short = records.from_bench(_bench(150.0, 8, 8 * 200, failed=1), _context("kbit-4", 1))
    assert "1 of 8 requests failed" in short["error"] and "1600 output tokens, expected 2048" in short["error"]
    gone = records.failed(_context("bf16", 1), "server died")
    assert gone["output_tok_s"] is None and gone["error"] == "server died"


def test_report_tables_ratios_and_plot(tmp_path):
    path = str(tmp_path / "r.jsonl")
    for method, bits, base in (("bf16", 16, 100.0), ("kbit-4", 4, 250.0)):
        for c in (1, 16):
            records.append(path, records.from_bench(_bench(base * c, max(8, 4 * c), max(8, 4 * c) * 256), _context(method, c, bits)))
    records.append(path, records.failed(_context("gptq-int4", 1), "vllm serve exited with 1 while starting"))
    records.append(path, records.from_bench(_bench(300.0, 8, 8 * 256), _context("kbit-4", 1)))  # a re-run replaces
    md = report.markdown(records.load([path]))
    assert "| kbit-4 | 300 (5.00 / 40) | 4000 (5.00 / 40) |" in md
    assert "| gptq-int4 | failed: vllm serve exited with 1 while starting |" in md
    assert "| kbit-4 | 3.00x | 2.50x |" in md  # relative to bf16
    assert "Prompts per bench: c=1 8, c=16 64" in md
    assert "| kbit-4 | 4 | 1 | 16.0 | 50.0 | 500,000 | 90 |" in md
    pytest.importorskip("matplotlib")
    written = report.write(records.load([path]), str(tmp_path / "r"))
    assert written == [str(tmp_path / "r.md"), str(tmp_path / "r.png")] and os.path.getsize(written[1]) > 10000


def test_skip_done_resumes_only_successful_steps_of_the_same_commit(tmp_path):
    path = str(tmp_path / "r.jsonl")
    records.append(path, records.from_bench(_bench(200.0, 8, 8 * 256), _context("kbit-4", 1)))
    records.append(path, records.failed(_context("kbit-4", 16), "bench timed out"))
    records.append(path, records.from_bench(_bench(900.0, 64, 64 * 256), {**_context("kbit-4", 64), "commit": "old"}))
    records.append(path, records.failed(_context("bf16", 1), "server died"))
    records.append(path, records.from_bench(_bench(190.0, 8, 8 * 256), _context("bf16", 1)))  # the re-run counts
    done = bench_serve.done_steps([path, str(tmp_path / "missing.jsonl")], "abc")
    assert done == {("kbit-4", 1024, 256, 1), ("bf16", 1024, 256, 1)}
    assert bench_serve.done_steps([path], "other") == set()


def test_report_lists_repeats_with_their_spread_and_runs_at_other_commits(tmp_path):
    path = str(tmp_path / "r.jsonl")
    for tok in (2600.0, 2860.0):  # two runs of one build
        records.append(path, records.from_bench(_bench(tok, 256, 256 * 256), _context("kbit-4", 64)))
    records.append(path, records.from_bench(_bench(3300.0, 256, 256 * 256), {**_context("kbit-4", 64), "commit": "old"}))
    records.append(path, records.failed(_context("kbit-4", 64), "bench timed out"))  # not a measurement
    records.append(path, records.from_bench(_bench(200.0, 8, 8 * 256), _context("kbit-4", 1)))  # measured once
    again = records.repeated(records.load([path]))
    assert list(again) == [("kbit-4", 1024, 256, 64, "abc")]
    assert [r["output_tok_s"] for r in again[("kbit-4", 1024, 256, 64, "abc")]] == [2600.0, 2860.0]
    md = report.markdown(records.load([path]))
    assert "| kbit-4 | 1024 / 256 | 64 | abc | 2600, 2860 | 10% |" in md
    assert "| kbit-4 | 1024 / 256 | 64 | 2600 (abc, 2026-11-23 10:00 UTC), 2860 (abc, 2026-11-23 10:00 UTC), " \
           "3300 (old, 2026-11-23 10:00 UTC) |" in md  # the run at another commit, listed beside them
    assert list(records.across_commits(records.load([path]))) == [("kbit-4", 1024, 256, 64)]
    assert "failed: bench timed out" in md  # the tables still show the last record


def test_settings_carry_their_prompts_per_concurrency():
    assert bench_serve.parse_settings("1024/256,128/1024:2") == [(1024, 256, 4), (128, 1024, 2)]
    assert bench_serve.parse_settings("32/16", per_concurrency=3) == [(32, 16, 3)]
    assert [bench_serve.num_prompts(c, p) for _, _, p in bench_serve.parse_settings("1/1,1/1:2") for c in (1, 64)] == [
        8, 256, 8, 128]
    for bad in ("1024-256", "1024/256:x", "1024/0", "128/1024:0"):
        with pytest.raises(ValueError, match="setting"):
            bench_serve.parse_settings(bad)


def test_bench_worker_runs_vllm_steps_survives_bad_ones_and_is_killed_at_its_timeout(tmp_path):
    """The long-lived `vllm bench serve` worker: vLLM's benchmark runs in it (against a port nobody listens on,
    every request fails and the benchmark says so), a step vLLM's parser rejects fails with its message while
    the same worker goes on, and a step past its timeout kills the worker."""
    pytest.importorskip("vllm.benchmarks.serve")
    import bench_client

    model = model_dir.write("tiny", str(tmp_path / "m"))
    args = ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{bench_serve.free_port()}", "--model", model,
            "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4", "--num-prompts", "2",
            "--ignore-eos", "--disable-tqdm"]
    client = bench_client.BenchClient(str(tmp_path / "worker.log"))
    try:
        client.start()
        worker = client.proc.pid
        rc, output = client.run(args, timeout_s=240)
        assert client.proc.pid == worker
        assert rc == 0 and "Serving Benchmark Result" in output and "Failed requests:                         2" in output
        rc, output = client.run(args + ["--no-such-flag"], timeout_s=120)
        assert rc == 2 and "unrecognized arguments: --no-such-flag" in output and client.proc.pid == worker
        assert "Serving Benchmark Result" not in output  # only this step's output
        with pytest.raises(TimeoutError, match="not finished after"):
            client.run(args, timeout_s=0.01)
        assert client.proc is None
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
    finally:
        client.close()


def test_gpu_monitor_summarizes_clocks_power_and_power_cap_samples(tmp_path, monkeypatch):
    import gpu_monitor

    text = "\n".join([
        "1980, 350.5, 45, 40, 0x0000000000000000",
        "1755, 699.9, 61, 100, 0x0000000000000004",  # SW power cap
        "Field \"x\" is not a valid field to query.",
        "1800, [N/A], 60, 100, 0x0",
        "1500, 690.1, 63, 100, 0x0000000000000024",  # power cap + SW thermal
    ])
    assert gpu_monitor.parse(text) == {
        "gpu_samples": 3, "sm_clock_mhz": 1745, "sm_clock_mhz_min": 1500, "power_w": 580, "power_w_max": 700,
        "gpu_temp_c_max": 63, "gpu_util_pct": 80, "clock_event_reasons": "0x24", "power_capped_pct": 67}
    assert gpu_monitor.parse("") == {}
    record = {**records.from_bench(_bench(3000.0, 256, 256 * 256), _context("kbit-4", 64)), **gpu_monitor.parse(text)}
    assert "| kbit-4 | 1024 / 256 | 64 | 1745 (1500) | 580 (700) | 63 | 80% | 0x24 | 67% |" in report.markdown([record])
    # The sampling process itself, with a stand-in nvidia-smi that prints one sample every 50 ms until stopped.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nwhile true; do echo '1600, 650.0, 70, 99, 0x4'; sleep 0.05; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with gpu_monitor.GpuMonitor(period_ms=50) as gpu:
        time.sleep(0.5)
    assert gpu.summary["gpu_samples"] >= 3 and gpu.summary["sm_clock_mhz"] == 1600
    assert gpu.summary["power_capped_pct"] == 100 and gpu.summary["clock_event_reasons"] == "0x4"
    with gpu_monitor.GpuMonitor(period_ms=50, max_s=1) as gpu:  # stops by itself at max_s
        time.sleep(1.5)
        assert gpu._proc.poll() is not None
    assert 5 <= gpu.summary["gpu_samples"] <= 30


def test_decode_profile_counts_overlapping_kernels_once_in_the_busy_time(monkeypatch):
    """Under programmatic dependent launch a kernel's span overlaps the one before it: the GPU-busy share is the
    union of kernel intervals, not the sum of their spans (which can pass 100% of the step)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after the test; the import sets it to 0
    import profile_decode

    assert profile_decode.union_length([(0.0, 10.0), (5.0, 15.0), (6.0, 7.0), (20.0, 25.0)]) == 20.0
    assert profile_decode.union_length([]) == 0.0
    kernels = {"kbit::mma_kernel": (60.0, 2.0), "kbit::moe_silu_mul_kernel": (50.0, 1.0)}  # spans summing past the step
    text = profile_decode.section("kbit-4", 16, 1024, 16, 100.0, kernels, True, 5, gpu_busy_us=80.0)
    assert "100 µs wall; GPU busy 80 µs (80% of the step); kernel times summed 110 µs" in text
    assert "| kbit | 110.0 | 100.0 |" in text


# ---- full-shape public models and the big-model row (benchmarks/serve/big.py) ------------------------------------

@pytest.mark.parametrize("name", sorted(model_dir.PUBLIC))
def test_public_model_directory_is_the_public_config_and_has_the_advertised_size(tmp_path, name):
    """Each full-shape model directory holds its recorded public config.json field for field, transformers parses it
    into its architecture, and the model it describes has the advertised total parameter count (within 3%)."""
    from transformers import AutoConfig, AutoTokenizer

    expected = {"qwen3-coder-next": ("Qwen3NextForCausalLM", "qwen3_next"),
                "glm-4.7-flash": ("Glm4MoeLiteForCausalLM", "glm4_moe_lite"),
                "qwen3-235b-a22b": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                "glm-4.5-air": ("Glm4MoeForCausalLM", "glm4_moe")}[name]
    d = model_dir.write(name, str(tmp_path / name))
    assert not [f for f in os.listdir(d) if f.endswith((".safetensors", ".bin"))]
    with open(os.path.join(d, "config.json")) as f:
        written = json.load(f)
    assert written == model_dir.public_config(name)
    c = AutoConfig.from_pretrained(d)
    assert (c.architectures, c.model_type) == ([expected[0]], expected[1])
    assert getattr(c, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == c.vocab_size and tok.eos_token_id == c.vocab_size - 1
    total, quantized = model_dir.parameter_counts(name)
    advertised = model_dir.PUBLIC[name].total_params_b * 1e9
    assert abs(total - advertised) <= 0.03 * advertised, (name, total / 1e9)
    assert 0.97 * total < quantized < total  # all but embeddings, head, router gates, norms
    g = model_dir.write(name, str(tmp_path / f"{name}-gptq"), model_dir.gptq_config(name))
    with open(os.path.join(g, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "gptq" and "mlp.experts" in qc["modules_in_block_to_quantize"]
    assert not any("gate" == m.rpartition(".")[2] for m in qc["modules_in_block_to_quantize"])  # no router gates


def test_public_model_shapes_are_the_target_architectures():
    qn, fl = model_dir.public_config("qwen3-coder-next"), model_dir.public_config("glm-4.7-flash")
    assert (qn["hidden_size"], qn["num_hidden_layers"], qn["num_experts"], qn["num_experts_per_tok"],
            qn["moe_intermediate_size"], qn["shared_expert_intermediate_size"], qn["full_attention_interval"]) == (
        2048, 48, 512, 10, 512, 512, 4)
    assert (fl["hidden_size"], fl["num_hidden_layers"], fl["n_routed_experts"], fl["num_experts_per_tok"],
            fl["q_lora_rank"], fl["kv_lora_rank"], fl["first_k_dense_replace"]) == (2048, 47, 64, 4, 768, 512, 1)
    big = model_dir.public_config("qwen3-235b-a22b")
    assert (big["hidden_size"], big["num_hidden_layers"], big["num_experts"], big["moe_intermediate_size"]) == (
        4096, 94, 128, 1536)
    # kbit-3 of the 235B shape fits one H200 (139 GiB) with room for KV cache; bf16 does not
    assert 85 < model_dir.weight_gib_estimate("qwen3-235b-a22b", 3.25) < 95
    assert model_dir.weight_gib_estimate("qwen3-235b-a22b", 16) > 400


def test_memory_samples_give_the_peak_per_gpu_up_to_a_time():
    import datetime

    import gpu_monitor

    text = "\n".join([
        "2026/11/28 15:00:00.100, 0, 1024",
        "2026/11/28 15:00:00.100, 1, 512",
        "2026/11/28 15:00:01.200, 0, 90112",  # loading: 88 GiB
        "No devices were found",
        "2026/11/28 15:00:05.000, 0, 133120",  # KV cache allocated: 130 GiB
        "2026/11/28 15:00:05.000, 1, [N/A]",
    ])
    assert gpu_monitor.parse_memory(text) == {0: 130.0, 1: 0.5}
    assert gpu_monitor.parse_memory(text, datetime.datetime(2026, 11, 28, 15, 0, 2)) == {0: 88.0, 1: 0.5}
    assert gpu_monitor.parse_memory("") == {}


@pytest.mark.parametrize("visible, ids", [("2,3", "2,3"), (" 1 ", "1"), ("", None), ("GPU-5b1c", None)])
def test_samplers_read_only_the_gpus_named_by_index_in_cuda_visible_devices(monkeypatch, visible, ids):
    import gpu_monitor

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu_monitor.visible_ids() == ids


def _big_row(monkeypatch, tmp_path, argv):
    import big

    monkeypatch.setattr(bench_serve, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(bench_serve, "commit", lambda: "abc")
    return big, big.BigRun(big.parse_args([*argv, "--out", str(tmp_path), "--work", str(tmp_path / "w")]))


def test_big_row_serves_dummy_weights_with_the_method_and_the_gdn_backend(tmp_path, monkeypatch):
    import vllm_server as vs

    monkeypatch.setenv("DEADLINE", "1234")
    big, run = _big_row(monkeypatch, tmp_path, ["--model", "qwen3-coder-next", "--method", "kbit-3"])
    assert run.args.deadline == 1234 and run.args.concurrency == "1,16,64"
    assert os.path.basename(run.stem).startswith("serve_big_") and run.results == run.stem + ".jsonl"
    monkeypatch.setattr(vs, "has_engine_arg", lambda name: name == "gdn_prefill_backend")
    args = run.serve_args(run.method_)
    assert args[:2] == ["--load-format", "dummy"] and "--tensor-parallel-size" not in args
    assert args[args.index("--gdn-prefill-backend") + 1] == "triton"
    assert json.loads(args[args.index("--hf-overrides") + 1])["quantization_config"]["bits"] == 3
    monkeypatch.setattr(vs, "has_engine_arg", lambda name: False)  # a vLLM without the setting
    assert "--gdn-prefill-backend" not in run.serve_args(run.method_)
    # 2 prompts per unit of concurrency, at least 4
    assert [bench_serve.num_prompts(c, run.settings[0][2], run.min_prompts) for c in (1, 16, 64)] == [4, 32, 128]
    _, run = _big_row(monkeypatch, tmp_path, ["--model", "qwen3-235b-a22b", "--method", "bf16", "--tp", "4"])
    args = run.serve_args(run.method_)
    assert args[args.index("--tensor-parallel-size") + 1] == "4" and "--gdn-prefill-backend" not in args
    assert "--quantization" not in args
    assert big.weight_load_s("(Worker_TP0) Model loading took 88.12 GiB memory and 312.5 seconds") == 312.5
    log = ("kbit: quantized 10 linear layers ...; peak GPU memory so far: 95.5 GiB allocated, 120 GiB reserved\n"
           "kbit: quantized 10 linear layers ...; peak GPU memory so far: 96.25 GiB allocated, 118 GiB reserved")
    assert big.torch_peak_gib(log) == {"torch_peak_allocated_gib": 96.25, "torch_peak_reserved_gib": 120.0}
    assert big.torch_peak_gib("no kbit line") == {}


def test_routing_option_sets_vllms_routing_simulation_for_the_server_and_the_records(tmp_path, monkeypatch):
    """--routing uniform_random: the server's environment has VLLM_MOE_ROUTING_SIMULATION_STRATEGY, the recorded
    command line starts with it and each record names the routing; the default leaves the model's router."""
    import vllm_server as vs

    started = {}

    def fake_start(model, port, log_path, args, env=None):
        started.update(env=env)
        return vs.Server(["vllm", "serve", model], log_path, port, None)

    monkeypatch.setattr(vs, "start", fake_start)
    for argv, env in (([], {}), (["--routing", "uniform_random"], {"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"})):
        _, run = _big_row(monkeypatch, tmp_path, ["--model", "glm-4.7-flash", "--method", "kbit-4", *argv])
        server = run.start_server("m", str(tmp_path / "log"), run.method_)
        assert started["env"] == env
        line = run.command_line(server)
        assert line.startswith("VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random vllm serve m") == bool(env)
        assert run.context(run.method_, "m", (1024, 256, 2), 16, {}, line)["routing"] == run.args.routing
    with pytest.raises(SystemExit):
        _big_row(monkeypatch, tmp_path, ["--model", "glm-4.7-flash", "--method", "kbit-4", "--routing", "skewed"])


def test_big_rows_report_load_memory_and_throughput_per_gpu(tmp_path, monkeypatch):
    big, run = _big_row(monkeypatch, tmp_path, ["--model", "qwen3-235b-a22b", "--method", "kbit-3"])
    facts = {"weight_gib": 91.2, "weight_gib_estimate": 90.9, "kv_cache_tokens": 301000, "startup_s": 420.0,
             "weight_load_s": 300.0, "peak_load_gib": 97.5, "peak_start_gib": 131.0}
    for c, tok in ((1, 40.0), (16, 500.0)):
        ctx = run.context(run.method_, "m", run.settings[0], c, facts, "vllm serve m")
        run.save(records.from_bench(_bench(tok, ctx["num_prompts"], ctx["num_prompts"] * 256), ctx))
    run.save(records.failed(run.context(run.method_, "m", run.settings[0], 64, facts, "vllm serve m"),
                            "skipped: 20 s left of the deadline"))
    _, tp4 = _big_row(monkeypatch, tmp_path, ["--model", "qwen3-235b-a22b", "--method", "bf16", "--tp", "4"])
    ctx = tp4.context(tp4.method_, "m", tp4.settings[0], 16, {"weight_gib": 110.0}, "vllm serve m --tp 4")
    tp4.save(records.from_bench(_bench(800.0, 32, 32 * 256), ctx))
    with open(run.stem + ".md") as f:
        md = f.read()
    assert ("| qwen3-235b-a22b | kbit-3 | 1 | 91.20 (90.9) | 301,000 | 420 (300) | 97.5 (131.0) | 40 | 40 | 5.00 | 40 "
            "| 500 | 500 | 5.00 | 40 | failed |  |  |  |") in md
    assert "| qwen3-235b-a22b | bf16 | 4 | 110.00 () |" in md and "| 800 | 200 | 5.00 | 40 |" in md
    assert "- qwen3-235b-a22b kbit-3 GPUs=1 c=64: skipped: 20 s left of the deadline" in md
    assert "- qwen3-235b-a22b bf16 GPUs=4: `vllm serve m --tp 4`" in md
    recs = records.load([run.results])
    assert [r["gpus"] for r in recs] == [1, 1, 1, 4] and recs[0]["model_name"] == "qwen3-235b-a22b"


def test_big_rows_of_separate_calls_merge_into_one_table(tmp_path, monkeypatch):
    big, a = _big_row(monkeypatch, tmp_path / "a", ["--model", "glm-4.7-flash", "--method", "kbit-4"])
    _, b = _big_row(monkeypatch, tmp_path / "b", ["--model", "glm-4.5-air", "--method", "bf16", "--tp", "4"])
    for run in (a, b):
        ctx = run.context(run.method_, "m", run.settings[0], 16, {"weight_gib": 15.0}, "vllm serve m")
        run.save(records.from_bench(_bench(900.0, 32, 32 * 256), ctx))
    md = big.merge([a.results, b.results], str(tmp_path / "all" / "serve_big_x"))
    assert [r["model_name"] for r in records.load([str(tmp_path / "all" / "serve_big_x.jsonl")])] == [
        "glm-4.7-flash", "glm-4.5-air"]
    with open(md) as f:
        text = f.read()
    assert "| glm-4.7-flash | kbit-4 | 1 |" in text and "| glm-4.5-air | bf16 | 4 |" in text and "| 900 | 225 |" in text


def test_big_rows_of_one_method_under_two_routings_stay_apart(tmp_path, monkeypatch):
    big, a = _big_row(monkeypatch, tmp_path / "a", ["--model", "qwen3-235b-a22b", "--method", "kbit-4"])
    _, b = _big_row(monkeypatch, tmp_path / "b", ["--model", "qwen3-235b-a22b", "--method", "kbit-4",
                                                  "--routing", "uniform_random"])
    for run, tok in ((a, 400.0), (b, 500.0)):
        ctx = run.context(run.method_, "m", run.settings[0], 16, {"weight_gib": 118.0}, "vllm serve m")
        run.save(records.from_bench(_bench(tok, 32, 32 * 256), ctx))
    with open(big.merge([a.results, b.results], str(tmp_path / "all" / "serve_big_x"))) as f:
        text = f.read()
    assert "| qwen3-235b-a22b | kbit-4 | 1 |" in text and "| 400 | 400 |" in text
    assert "| qwen3-235b-a22b | kbit-4, uniform_random routing | 1 |" in text and "| 500 | 500 |" in text
