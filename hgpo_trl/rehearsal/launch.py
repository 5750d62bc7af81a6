"""The rehearsal's launches: its accelerate file (the user's, on CPUs in float32), its model (a tiny twin of the
real one with the real tokenizer), and two `accelerate launch` runs of `train.py`: iterations 1-2 with a
checkpoint, then iteration 3 resumed from it. A file of several machines is launched as that many machine ranks
on this host."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hgpo_trl.commands.arguments import ConfigError
from hgpo_trl.commands.parser import command_name

MARKER = "REHEARSAL"  # a folder holding it is a rehearsal's, which a new rehearsal may clear
MARK = "HGPO_REHEARSAL_LAUNCH"  # in every launched process's environment: how they are all found and stopped
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # (one the user ignores, as nohup does, stays so)


@dataclass(frozen=True)
class LaunchFile:
    """The accelerate file's settings that the rehearsal keeps and reports."""

    path: str | None
    settings: dict[str, Any]

    @property
    def machines(self) -> int:
        return int(self.settings.get("num_machines", 1))

    @property
    def processes(self) -> int:  # over all machines, as accelerate counts num_processes
        return int(self.settings.get("num_processes", 1))

    @property
    def uses_deepspeed(self) -> bool:
        return self.settings.get("distributed_type") == "DEEPSPEED"

    @property
    def deepspeed(self) -> dict[str, Any]:
        return (self.settings.get("deepspeed_config") or {}) if self.uses_deepspeed else {}

    @property
    def zero_stage(self) -> int:
        return int(self.deepspeed.get("zero_stage", 0))

    def offloads(self, what: str) -> bool:
        return str(self.deepspeed.get(f"offload_{what}_device", "none")).lower() not in ("none", "")

    @property
    def zero3_init(self) -> bool:  # accelerate's zero3_init_flag, on by default at ZeRO-3
        return str(self.deepspeed.get("zero3_init_flag", True)).lower() == "true"

    @property
    def bf16(self) -> bool:
        return str(self.settings.get("mixed_precision", "no")) == "bf16"


def read_launch_file(path: str | None, config_file: str | None) -> LaunchFile:
    """The accelerate file `path` (HGPOConfig.accelerate_config), found from the working directory or the config
    file's folder and those above it; None: one process, no distribution."""
    if path is None:
        return LaunchFile(None, {"distributed_type": "NO", "num_processes": 1, "num_machines": 1})
    candidates = [Path(path)]
    if config_file and not Path(path).is_absolute():
        candidates += [folder / path for folder in Path(config_file).resolve().parents]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ConfigError(f"HGPOConfig.accelerate_config: {path} does not exist (looked from the working directory "
                          "and from the config file's folder up)")
    try:
        settings = yaml.safe_load(found.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"HGPOConfig.accelerate_config: cannot read {found}: {str(err).splitlines()[0]}") from None
    if not isinstance(settings, dict) or "num_processes" not in settings:
        raise ConfigError(f"HGPOConfig.accelerate_config: {found} is not an accelerate config file (no "
                          "num_processes; `accelerate config` writes one)")
    if settings.get("distributed_type") in ("FSDP", "MEGATRON_LM", "XLA", "TPU"):
        raise ConfigError(f"HGPOConfig.accelerate_config: {found} uses distributed_type "
                          f"{settings['distributed_type']}, which the rehearsal does not run (it runs NO, MULTI_GPU "
                          "and DEEPSPEED files)")
    return LaunchFile(str(found), settings)


def cpu_launch_file(launch: LaunchFile, port: int) -> dict[str, Any]:
    """The user's accelerate settings on CPUs: float32 (`mixed_precision: no`), `use_cpu`, the same processes,
    machines, ZeRO stage and offloads; on this host (every machine rank at 127.0.0.1)."""
    settings = {k: v for k, v in launch.settings.items() if k not in ("gpu_ids", "downcast_bf16")}
    settings.update(mixed_precision="no", use_cpu=True, main_process_port=port)
    if settings.get("distributed_type", "NO") == "NO" and launch.processes > 1:
        settings["distributed_type"] = "MULTI_GPU"
    if launch.machines > 1:
        settings.update(main_process_ip="127.0.0.1", same_network=True, rdzv_backend="static")
        if launch.uses_deepspeed:  # accelerate's default multi-node DeepSpeed launcher is pdsh, over ssh to a hostfile
            settings["deepspeed_config"] = {**launch.deepspeed, "deepspeed_multinode_launcher": "standard"}
    return settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_folder(folder: Path) -> None:
    """An empty rehearsal folder: one of an earlier rehearsal is cleared; anything else is refused (nothing a
    run wrote is deleted)."""
    if folder.exists() and any(folder.iterdir()):
        if not (folder / MARKER).is_file():
            raise ConfigError(f"--rehearse writes into {folder}, which exists and is not a rehearsal's: move it, or "
                              "set output_dir to another folder")
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text("A rehearsal's folder (python train.py --rehearse): a new rehearsal clears it.\n")


def build_model(shape, tokenizer, folder: Path) -> Path:
    """The rehearsal's model: a tiny twin of `shape` (same architecture, embedding rows, tying and query
    groups), random weights, saved with the real tokenizer."""
    from hgpo_trl.rehearsal.shapes import build_model_folder, tiny_twin
    from hgpo_trl.runtime.progress import transformers_bars_off

    if len(tokenizer) > shape.vocab_rows:
        raise ConfigError(f"--rehearse_tokenizer: its {len(tokenizer)} tokens do not fit the model's "
                          f"{shape.vocab_rows} embedding rows: is it the tokenizer of this model?")
    with transformers_bars_off():
        return build_model_folder(tiny_twin(shape), tokenizer, folder)


def launch(launch_file: Path, machines: int, argv: list[str], log: Path, timeout: float, bound: str = "",
           watch: Callable[[float, str, Path], None] | None = None) -> float:
    """Run `train.py argv` under `launch_file`, one `accelerate launch` per machine rank, all on this host; wall
    seconds (`run_launches`: `timeout` and `bound`, what set it; `watch`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "DS_ACCELERATOR": "cpu"}
    commands = [([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch_file),
                  "--machine_rank", str(rank), "-m", "hgpo_trl.commands.train", *argv],
                 log.with_name(f"{log.stem}{'' if machines == 1 else f'_machine{rank}'}.log"))
                for rank in range(machines)]
    return run_launches(commands, env, timeout, bound, watch)


def build_deepspeed_op() -> float:
    """DeepSpeed's CPU collective op (deepspeed_shm_comm) made ready in one process before a launch, where the
    launched ranks look for it (TORCH_EXTENSIONS_DIR, set by `hgpo_trl` to the venv's, where set-up built it): they
    load it, and none compiles it inside the launch (torch's lock makes the others wait minutes for the one that
    does); its seconds (a load: seconds; a first build: 1-4 minutes)."""
    start = time.time()
    # In a session of its own, stopped with every compiler it started whatever ends the wait (a signal: `stopping`).
    build = subprocess.Popen([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                             env={**os.environ, "DS_ACCELERATOR": "cpu"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = build.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    if build.returncode:
        raise RehearsalError(f"DeepSpeed's CPU op did not build (make deepspeed-ops builds it at set-up): "
                             f"{(err.strip().splitlines() or ['no output'])[-1]}")
    return time.time() - start


class Stopped(BaseException):
    """A STOP_SIGNALS signal while `stopping` holds (its name)."""


def _stop(number: int, frame) -> None:
    for each in STOP_SIGNALS:  # a second signal must not cut the stopping short (nor raise a second Stopped)
        signal.signal(each, signal.SIG_IGN)
    raise Stopped(signal.Signals(number).name)


@contextlib.contextmanager
def stopping() -> Iterator[None]:
    """STOP_SIGNALS raise `Stopped` while the block runs (one the user ignores, as nohup does, stays ignored); the
    previous handlers after. Signal handlers live in the main thread: elsewhere, none."""
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.signal(s, _stop) for s in STOP_SIGNALS if main and signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def run_launches(commands: list[tuple[list[str], Path]], env: dict[str, str], timeout: float,
                 bound: str = "", watch: Callable[[float, str, Path], None] | None = None) -> float:
    """Run each (command, log), all at once; wall seconds once all ended well. When one fails, `timeout` passes
    (`bound`: what set it), a SIGINT (Ctrl-C), SIGTERM or SIGHUP arrives or anything else goes wrong, every
    process they started is stopped before this returns or raises (`stop_marked`), and RehearsalError says why
    and which log to read (one line for a signal). `watch(seconds so far, the launch's mark, the first log)` is
    called as it waits (`watch.LaunchWatch`: the lines that say where the launch is)."""
    mark, start, running = uuid.uuid4().hex, time.time(), []
    failed = None
    with stopping():
        try:
            for command, out in commands:
                with out.open("w") as file:
                    # In a session of its own: a terminal's Ctrl-C reaches this process alone, which stops them all.
                    running.append((subprocess.Popen(command, env={**env, MARK: mark}, stdout=file,
                                                     stderr=subprocess.STDOUT, start_new_session=True), out))
            while failed is None and any(proc.poll() is None for proc, _ in running):
                failed = next(((f"exit code {proc.returncode}", out) for proc, out in running
                               if proc.poll() not in (None, 0)), None)
                if failed is None and time.time() - start > timeout:
                    failed = (f"no end within {timeout:.0f} s{f' ({bound})' if bound else ''}: hung?", running[0][1])
                if failed is None and watch is not None:
                    watch(time.time() - start, mark, commands[0][1])
                time.sleep(0.5)
            failed = failed or next(((f"exit code {proc.returncode}", out) for proc, out in running
                                     if proc.returncode), None)
        except Stopped as stop:
            raise RehearsalInterrupted(f"interrupted by {stop}: every process the launch started was stopped (its "
                                       f"logs: {', '.join(str(out) for _, out in running) or 'none yet'})",
                                       getattr(signal, str(stop))) from None
        finally:
            for number in STOP_SIGNALS:  # a second Ctrl-C must not cut the stopping short (`stopping` restores)
                if signal.getsignal(number) is _stop:
                    signal.signal(number, signal.SIG_IGN)
            for proc, _ in running:  # each launcher's process group, then every process that holds the mark
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            stop_marked(mark)
            for proc, _ in running:
                proc.wait()
    if failed is not None:
        why, out = failed
        lines = out.read_text(errors="replace").splitlines()
        # The first error a process reported, before torch elastic's summary of the failed ranks.
        cause = next((line for line in lines if ("error" in line.lower() or "Traceback" in line)
                      and "ChildFailedError" not in line and "elastic" not in line), "")
        tail = "\n".join(lines[-15:])
        raise RehearsalError(f"the rehearsal's launch failed ({why}): {cause.strip() or 'see its log'}\n"
                             f"(read its log: {out}; its end:)\n{tail}")
    return time.time() - start


def stop_marked(mark: str) -> None:
    """SIGKILL every process whose environment holds `mark` until none is left: the launchers, the ranks (torch
    elastic starts each in a session of its own, out of reach of its launcher's process group) and their
    environment workers, wherever they were reparented. psutil is accelerate's own dependency."""
    import psutil

    def marked(proc) -> bool:
        try:
            return proc.environ().get(MARK) == mark
        except psutil.Error:  # gone, a zombie, or another user's
            return False

    for _ in range(10):  # (one that outlives SIGKILL this long is stuck in the kernel: left to it)
        found = [proc for proc in psutil.process_iter() if marked(proc)]
        if not found:
            return
        for proc in found:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(found, timeout=5)


class RehearsalError(RuntimeError):
    """A rehearsal launch failed: what a real run of this config would have met."""


class RehearsalInterrupted(RehearsalError):
    """A signal stopped the rehearsal (`signal`: its number, for the exit status 128 + it)."""

    def __init__(self, message: str, number: int):
        super().__init__(message)
        self.signal = number


def rehearsal_failed(err: RehearsalError) -> None:
    """train.py --rehearse's end on `err`: one line; exit 1, or 128 + the signal that stopped it (as a shell says)."""
    print(f"{command_name('train.py')} --rehearse: {err}", file=sys.stderr)
    raise SystemExit(128 + err.signal if isinstance(err, RehearsalInterrupted) else 1) from None
