"""The vLLM runs that tests/test_vllm_cpu.py checks, in one process of their own, started once for all of them:
vLLM takes ~40 s to import and changes its process (RANK, WORLD_SIZE and MASTER_PORT set, torch.distributed set
up), so it runs beside pytest, not in it. On one tiny model of head size 32 (vLLM's CPU attention has no smaller
one), it plays greedy evaluations with vLLM and with transformers (hgpo-eval's command line, evaluate_model),
trains HGPO with colocated vLLM (continuous rollouts), then probes the weight sync: vLLM's
greedy completions and log-probabilities against the trainer model's, before and after a sync; and the streamed
requests: seeded samples alone and batched, greedy rollouts lock-step and continuous, and rollouts after one that a
Ctrl-C interrupted. Then a vLLM server started by hgpo-serve: its answers on the first weights, HGPO trained
with it as the engine, with the same sync probe, and trained with generation beside training (async_generation:
tests/vllm_ahead_runs.py), its stop, resume and the server's failures. Writes results.json in the folder it is given.

    python tests/vllm_cpu_runs.py OUT
"""

import json
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from hgpo_trl.commands import evaluate
from hgpo_trl.commands.players import load_tokenizer
from hgpo_trl.config import HGPOConfig
from hgpo_trl.envs import make_env, make_tasks
from hgpo_trl.envs.pool import InProcessEnvs
from hgpo_trl.evaluation.trajectories import read_records
from hgpo_trl.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny
from hgpo_trl.models.warmstart import warm_start
from hgpo_trl.rollout import generation
from hgpo_trl.rollout.continuous import run_continuous
from hgpo_trl.rollout.generation import (
    ModelPolicy,
    generate_completions,
    prompts_per_call,
    sampled_logprobs,
    trainer_generator,
)
from hgpo_trl.rollout.lockstep import run_rollout
from hgpo_trl.rollout.vllm_cpu import VERSION_METHOD, call_server
from hgpo_trl.rollout.vllm_stream import ServerStream, VLLMStream
from hgpo_trl.trainer import HGPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import keydoor_corpus
from tests.vllm_ahead_runs import interrupted_and_resumed, played_ahead, server_failures, two_processes_ahead

GAME = {"env_name": "keydoor", "action_mode": "plain", "max_env_steps": 5, "max_completion_length": 4,
        "vllm_max_model_length": 512, "report_to": "none", "bf16": False, "use_cpu": True}
# The evaluations load the model in float32 on both engines: vLLM's "auto" dtype turns a float32 checkpoint into
# bfloat16, and a greedy choice between two tokens closer than bfloat16's rounding would then differ.
EVAL_DTYPE = "float32"
PROBE_TOKENS = 12  # completion tokens compared in the sync probe
# The tiny model wins few games in 3 iterations: keydoor's reward for taking the gold's key gives its training runs
# advantages to learn from (without one, every step's advantage was 0 and no weight moved).
REWARDED = {"key_reward": 1.0}


def games(folder: Path) -> list[tuple]:
    """Each step an evaluation dumped: (episode, step, completion text, action, won)."""
    (dump,) = sorted((folder / "trajectories").glob("*.jsonl"))
    return [(r["episode"], r["step"], r["output"], r["action"], r["episode_won"]) for r in read_records(dump)]


def evaluations(path: Path, out: Path) -> dict:
    """The same greedy games with vLLM and transformers: hgpo-eval's command line, then evaluate_model."""
    config = out / "eval.yaml"
    config.write_text("".join(f"{key}: {str(value).lower() if isinstance(value, bool) else value}\n"
                              for key, value in GAME.items()) + "num_eval_tasks: 6\ntrajectory_dump_every: 1\n")
    reports = {}
    for flag in ("true", "false"):
        folder = out / f"hgpo_eval_vllm_{flag}"
        evaluate.main(["--config", str(config), "--model_name_or_path", str(path), "--greedy", "--seeds", "1",
                       "--splits", "train", "--use_vllm", flag, "--dtype", EVAL_DTYPE, "--eval_output_dir", str(folder)])
        reports[f"hgpo_eval_{flag}"] = {**json.loads((folder / "evaluation.json").read_text()), "games": games(folder)}
    args = HGPOConfig(output_dir=str(out / "unused"), use_vllm=True, trajectory_dump_every=1, **GAME)
    result = evaluate.evaluate_model(str(path), args, greedy=True, seeds=[1], splits=["train"], num_eval_tasks=6,
                                     dtype=EVAL_DTYPE,
                                     eval_output_dir=str(out / "model_vllm"))
    reports["evaluate_model"] = {**result.report, "games": games(out / "model_vllm")}
    return reports


def teacher_forced(model, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[tuple]:
    """The trainer model's logits at each completion token, teacher-forced, beside the tokens."""
    with torch.no_grad():
        return [(model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].float(),
                 torch.tensor(completion)) for prompt, completion in zip(prompt_ids, completion_ids, strict=True)]


def completion_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
    """The trainer model's log-probability of each completion token, teacher-forced."""
    return [logits.log_softmax(-1)[torch.arange(len(ids)), ids].tolist()
            for logits, ids in teacher_forced(model, prompt_ids, completion_ids)]


def greedy_margins(model, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> dict:
    """At each token of greedy completions, teacher-forced in the trainer model: how far its log-probability falls
    short of the model's top one (0.0: the model's own greedy choice), the model's margin between its top two
    tokens, and the largest logit's magnitude (which sets bfloat16's rounding)."""
    shortfalls, margins, scale = [], [], 0.0
    for logits, ids in teacher_forced(model, prompt_ids, completion_ids):
        logprobs = logits.log_softmax(-1)
        top = logprobs.topk(2, dim=-1).values
        shortfalls.append((top[:, 0] - logprobs[torch.arange(len(ids)), ids]).tolist())
        margins.append((top[:, 0] - top[:, 1]).tolist())
        scale = max(scale, logits.abs().max().item())
    return {"shortfalls": shortfalls, "margins": margins, "logit_scale": scale}


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def probe_prompts() -> list[str]:
    """The first prompt of 6 keydoor tasks."""
    env, texts = make_env("keydoor"), []
    for task in make_tasks("keydoor", "train", num_tasks=6):
        observation, info = env.reset(task)
        texts.append(env.render_prompt(info["task"], [], observation, info["admissible_actions"], 0))
    return texts


def greedy(model, tokenizer, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy completions of PROBE_TOKENS tokens."""
    config = GenerationConfig(max_new_tokens=PROBE_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    return generate_completions(model, config, prompt_ids, tokenizer.pad_token_id, [tokenizer.eos_token_id])


def sync_probe(trainer: HGPOTrainer) -> dict:
    """vLLM's greedy completions and log-probabilities against the trainer model's: stale (the model has taken an
    optimizer step since the last sync), then right after the sync that `trainer_generator` makes."""
    policy = ModelPolicy(trainer._tokenizer, None)
    prompt_ids = [policy.encode(text) for text in probe_prompts()]
    backend, model = trainer.vllm_generation, trainer.model.eval()
    backend.max_completion_length, backend.temperature = PROBE_TOKENS, 0.0
    assert trainer.state.global_step != trainer._last_loaded_step, "the probe needs a step since the last sync"
    _, stale_ids, stale_logprobs, _ = backend.generate(prompts=prompt_ids, images=None, num_generations=1)
    stale = [[lp[0] for lp in row] for row in stale_logprobs]
    with trainer_generator(trainer, 0.0) as generate:
        synced_ids, synced = generate(prompt_ids)
    hf_ids = greedy(model, trainer._tokenizer, prompt_ids)
    dtype = backend.llm.llm_engine.model_config.dtype if backend.mode == "colocate" else \
        "torch." + str(backend.vllm_client.get_server_info()["model_config"]["dtype"]).removeprefix("torch.")
    return {"dtype": str(dtype), "prompts": len(prompt_ids),
            "stale_gap": largest_gap(stale, completion_logprobs(model, prompt_ids, stale_ids)),
            "synced_gap": largest_gap(synced, completion_logprobs(model, prompt_ids, synced_ids)),
            "synced_ids": [list(ids) for ids in synced_ids], "hf_ids": hf_ids,
            "synced_greedy": greedy_margins(model, prompt_ids, synced_ids),
            "stale_greedy": greedy_margins(model, prompt_ids, stale_ids),
            "stale_ids": [list(ids) for ids in stale_ids]}


def request_stream(trainer: HGPOTrainer, temperature: float, prompt_ids, decode):
    """The trainer's engine as a stream of requests: colocated vLLM's, or a server's."""
    backend = trainer.vllm_generation
    if backend.mode == "colocate":
        return VLLMStream(backend, temperature, prompt_ids, decode)
    return ServerStream(backend.vllm_client, backend, temperature, prompt_ids, decode, concurrency=8)


def seeded_samples(trainer: HGPOTrainer, prompt_ids: list[list[int]], batches: list[list[int]]) -> dict:
    """Completions at temperature 1 of the prompts, each batch of indices submitted together to a request stream
    whose rollout seed is the same (so request i has the same seed in every batch)."""
    completions = {}
    for batch in batches:
        torch.manual_seed(7)  # (the stream draws its rollout seed from torch's stream)
        stream = request_stream(trainer, 1.0, lambda text: prompt_ids[int(text)], trainer._tokenizer.decode)
        for i in batch:
            stream.submit(i, str(i), 0)
        done = {}
        while len(done) < len(batch):
            done.update(stream.finished())
        completions.update(done)
    return completions


def stream_probe(trainer: HGPOTrainer) -> dict:
    """What a seed per request buys: each probe prompt sampled alone and then in one batch with the others (same
    seeds), the tokens and log-probabilities compared; and greedy keydoor rollouts, lock-step and continuous, on
    the synced engine, step by step."""
    policy = ModelPolicy(trainer._tokenizer, None)
    prompt_ids = [policy.encode(text) for text in probe_prompts()]
    alone = seeded_samples(trainer, prompt_ids, [[i] for i in range(len(prompt_ids))])
    together = seeded_samples(trainer, prompt_ids, [list(range(len(prompt_ids)))])
    same = [alone[i].completion_ids == together[i].completion_ids for i in range(len(prompt_ids))]
    gap = largest_gap([alone[i].logprobs for i in range(len(same)) if same[i]],
                      [together[i].logprobs for i in range(len(same)) if same[i]])
    tasks, settings = list(make_tasks("keydoor", "train", num_tasks=8)), trainer.rollout_settings
    with trainer_generator(trainer, 0.0) as generate:
        player = ModelPolicy(trainer._tokenizer, generate)
        envs = InProcessEnvs(partial(make_env, "keydoor", max_steps=5), len(tasks))
        lockstep = run_rollout(envs, tasks, 1, player, settings, count_tokens=player.count_tokens)
        stream = request_stream(trainer, 0.0, lambda text: player.prompt_ids([text])[0],
                                partial(trainer._tokenizer.decode, skip_special_tokens=True))
        continuous = run_continuous(envs, tasks, 1, stream, settings, count_tokens=player.count_tokens)
    steps = list(zip(lockstep.steps, continuous.steps, strict=False))  # (games may part)
    return {"seeded_same_tokens": sum(same), "seeded_prompts": len(same), "seeded_logprob_gap": gap,
            "greedy_steps": [len(lockstep.steps), len(continuous.steps)],
            "greedy_same_steps": sum((a.traj, a.step, a.prompt, a.completion.completion_ids, a.action, a.reward)
                                     == (b.traj, b.step, b.prompt, b.completion.completion_ids, b.action, b.reward)
                                     for a, b in steps),
            "greedy_logprob_gap": largest_gap([a.completion.logprobs for a, _ in steps],
                                              [b.completion.logprobs for _, b in steps])}


def after_an_interruption(trainer: HGPOTrainer, tasks: list) -> dict:
    """A greedy rollout of `tasks`, the same with a Ctrl-C (a real SIGINT to this process) during its third engine
    step (after the model ran, before vLLM read its outputs), then the same again on the same engine: the engine
    steps run, the requests the engine still held after the interruption, whether the last played the first's steps."""
    engine, calls = trainer.vllm_generation.llm.llm_engine, []
    clean = trainer._play(tasks, 1, 0.0)

    def interrupted(*args, process=engine.output_processor.process_outputs, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return process(*args, **kwargs)

    engine.output_processor.process_outputs = interrupted
    try:
        trainer._play(tasks, 1, 0.0)
    except KeyboardInterrupt:
        pass
    finally:
        del engine.output_processor.process_outputs  # (the instance's own: the class's method again)
    left = engine.get_num_unfinished_requests()
    again = trainer._play(tasks, 1, 0.0)
    return {"engine_steps": len(calls), "left": left, "same_steps": [
        (s.traj, s.step, s.completion.completion_ids, s.action) for s in again.steps] == [
        (s.traj, s.step, s.completion.completion_ids, s.action) for s in clean.steps]}


def no_answer(*_) -> None:
    raise TimeoutError("no answer in 120 s (an engine left with requests that never finish steps forever)")


def interrupted_rollouts(trainer: HGPOTrainer) -> dict:
    """`after_an_interruption` in each rollout mode, on 8 keydoor tasks, or the error it met; each mode from a clean
    engine, whatever the code under test left in it, and under an alarm (TRL's generate on an engine that holds
    requests whose outputs were lost steps forever)."""
    tasks, mode_trained, report = list(make_tasks("keydoor", "train", num_tasks=8)), trainer.args.rollout_mode, {}
    engine, previous = trainer.vllm_generation.llm.llm_engine, signal.signal(signal.SIGALRM, no_answer)
    for mode in ("continuous", "lockstep"):
        trainer.args.rollout_mode = mode
        signal.alarm(120)
        try:
            report[mode] = after_an_interruption(trainer, tasks)
        except Exception as err:  # (a KeyError for a request id of the interrupted rollout; the alarm)
            report[mode] = {"error": f"{type(err).__name__}: {err}"}
        finally:
            signal.alarm(0)
            engine.abort_request(list(engine.output_processor.request_states), internal=True)
    signal.signal(signal.SIGALRM, previous)
    trainer.args.rollout_mode = mode_trained
    return report


def training(path: Path, out: Path) -> dict:
    """Two HGPO iterations with colocated vLLM, counting the weight syncs (the stream and interruption probes before
    them, on the first weights), then the sync probe and an evaluation."""
    args = HGPOConfig(output_dir=str(out / "run"), per_device_train_batch_size=16, num_generations=4,
                      tasks_per_device=2, invalid_action="end_episode", learning_rate=1e-2, train_iterations=2,
                      logging_steps=1, save_strategy="no", use_vllm=True, vllm_mode="colocate", env_kwargs=REWARDED,
                      rollout_mode="continuous", **GAME)  # ('auto' plays these 4-token completions lock-step)
    trainer = HGPOTrainer(model=str(path), args=args, train_dataset=make_tasks("keydoor", "train", num_tasks=8),
                          eval_dataset=make_tasks("keydoor", "valid", num_tasks=2))
    syncs, sync = [], generation.sync_weights

    def counted(backend, version, *rest):
        syncs.append(version)
        sync(backend, version, *rest)

    generation.sync_weights = counted
    streams = stream_probe(trainer)  # (first: the warm-started weights' greedy games last several steps)
    interruptions = interrupted_rollouts(trainer)
    trainer.train()
    trained = {"syncs": list(syncs), "global_step": trainer.state.global_step,
               "continuous": trainer.args.plays_continuously(trainer._env_workers)}
    probe = sync_probe(trainer)
    evaluated = trainer.evaluate()
    generation.sync_weights = sync
    logs = [h for h in trainer.state.log_history if "env/success_rate" in h]
    return {**trained, "iterations": len(logs), "collected": [h["steps/collected"] for h in logs],
            "eval_tasks": evaluated["eval_tasks"], "probe": probe, "streams": streams, "interruptions": interruptions}


def serve(path: Path, out: Path, dtype: str = EVAL_DTYPE) -> tuple[subprocess.Popen, int]:
    """A vLLM server for `path` on 127.0.0.1 through hgpo-serve (its CPU weight sync included), in `dtype`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "hgpo_trl.commands.serve", "--model", str(path), "--port", str(port),
               "--dtype", dtype, "--max_model_len", "512", "--enforce-eager"]
    log = (out / f"server_{dtype}.log").open("w")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log), port


def server_training(path: Path, out: Path, port: int) -> dict:
    """Two HGPO iterations with the server as the engine (continuous rollouts, its weights synced through a file
    after each optimizer step; the stream probe before), the weights it reports, then the sync probe."""
    trainer = server_trainer(path, out, port, "run", train_iterations=2)
    syncs, sync = [], generation.sync_weights

    def counted(backend, version, *rest):
        syncs.append(version)
        sync(backend, version, *rest)

    generation.sync_weights = counted
    streams = stream_probe(trainer)  # (on the first weights, as in training())
    trainer.train()
    generation.sync_weights = sync
    client = trainer.vllm_generation.vllm_client
    served = call_server(client, VERSION_METHOD)
    probe = sync_probe(trainer)
    return {"syncs": syncs, "global_step": trainer.state.global_step, "served_before_probe": served,
            "served_after_probe": call_server(client, VERSION_METHOD), "probe": probe, "streams": streams,
            "continuous": trainer.args.plays_continuously(trainer._env_workers),
            "iterations": len([h for h in trainer.state.log_history if "env/success_rate" in h]),
            "push_seconds": [h["time/weight_push"] for h in trainer.state.log_history if "time/weight_push" in h]}


def bfloat16_server_training(path: Path, out: Path, port: int) -> dict:
    """One HGPO iteration with a bfloat16 server (`hgpo-serve --dtype bfloat16`, the fast one on a CPU with bfloat16
    units), then the sync probe: the trainer's float32 weights pushed into its bfloat16 layers."""
    trainer = server_trainer(path, out, port, "bf16_run", train_iterations=1)
    trainer.train()
    return {"probe": sync_probe(trainer), "global_step": trainer.state.global_step}


def server_generation(path: Path, port: int) -> dict:
    """Greedy completions through the server with TRL's client, handled as the trainer handles a server's answers
    (a process with 2 prompts fewer than the busiest sends dummy prompts after its own, whose answers are dropped),
    against transformers' on the same float32 weights."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=300)
    sent = []

    def generate(prompt_ids):
        sent.append(len(prompt_ids))
        answer = client.generate(prompts=prompt_ids, temperature=0.0, max_tokens=PROBE_TOKENS, logprobs=0)
        return answer["completion_ids"], sampled_logprobs(answer["logprobs"])

    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(str(path))
    policy = ModelPolicy(tokenizer, generate, call_size=lambda n: prompts_per_call(n, [n, n + 2]))
    texts = probe_prompts()
    completions = policy(texts)
    ids = [list(c.completion_ids) for c in completions]
    prompt_ids = [policy.encode(text) for text in texts]
    return {"sent": sent, "completions": len(completions), "ids": ids, "hf_ids": greedy(model, tokenizer, prompt_ids),
            "gap": largest_gap([c.logprobs for c in completions], completion_logprobs(model, prompt_ids, ids))}


def server_trainer(path: Path, out: Path, port: int, name: str, **overrides) -> HGPOTrainer:
    """A trainer of three HGPO iterations on the server (continuous, sampled; every iteration's steps dumped), its
    output in out/server_`name` (tests/vllm_ahead_runs.py's runs)."""
    args = HGPOConfig(**{"output_dir": str(out / f"server_{name}"), "per_device_train_batch_size": 16,
                         "num_generations": 4, "tasks_per_device": 2, "invalid_action": "end_episode",
                         "learning_rate": 1e-2, "train_iterations": 3, "logging_steps": 1, "save_strategy": "no",
                         "use_vllm": True, "vllm_mode": "server", "rollout_mode": "continuous",
                         "vllm_server_base_url": f"http://127.0.0.1:{port}", "env_kwargs": REWARDED,
                         "vllm_server_timeout": 300, "trajectory_dump_every": 1, **GAME, **overrides})
    return HGPOTrainer(model=str(path), args=args, train_dataset=make_tasks("keydoor", "train", num_tasks=8))


def main(out: Path) -> None:
    tokenizer = build_tiny_tokenizer(keydoor_corpus())
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, seed=0)  # head size 32
    # Warm-started (5 s) so that its games are valid actions of several steps, not the same invalid output.
    warm_start(model, tokenizer, lambda: make_env("keydoor", max_steps=5),
               list(make_tasks("keydoor", "train", num_tasks=8)), steps=30, max_steps=5, batch_size=16,
               learning_rate=3e-3, use_cpu=True)
    path = save_tiny(model, tokenizer, out / "tiny")
    server, port = serve(path, out)  # (they start while the rest runs)
    bfloat16_server, bfloat16_port = serve(path, out, "bfloat16")
    try:
        results = {"evaluations": evaluations(path, out), "training": training(path, out),
                   "server": server_generation(path, port)}
        results["server_training"] = server_training(path, out, port)  # (after: it changes the server's weights)
        try:  # (a failure here fails its own test alone)
            results["bfloat16_server"] = bfloat16_server_training(path, out, bfloat16_port)
        except Exception as err:
            results["bfloat16_server"] = {"error": f"{type(err).__name__}: {err}"[-2000:]}
        bfloat16_server.terminate()
        make_trainer = partial(server_trainer, path, out, port)
        results["played_ahead"] = played_ahead(make_trainer)
        results["interrupted_ahead"] = interrupted_and_resumed(make_trainer)
        results["two_processes_ahead"] = two_processes_ahead(path, out, port)
        results["server_failures"] = server_failures(make_trainer, server)  # (last: it kills the server)
    finally:
        for running in (server, bfloat16_server):
            running.terminate()
        for running in (server, bfloat16_server):
            try:
                running.wait(timeout=60)
            except subprocess.TimeoutExpired:
                running.kill()
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
