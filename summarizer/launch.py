"""How a command ends: its one error ladder, the stop signals of a run, and training from a notebook cell."""
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch

from command_line import DiskFull, UserError, error_line, first_line
from config import load_config
from summarizer import run_folder
from summarizer.checkpoint import intact_in

FORKED_CUDA = "Cannot re-initialize CUDA in forked subprocess"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # a run saves ckpt.pt after the step in progress and stops


class StopSignals:
    """SIGINT and SIGTERM stop the run: in start-up at once, in training() after the step in progress, a second Ctrl-C
    at once. Under torchrun an error leaves them caught: the launcher's SIGTERM must not end a rank before its line."""

    def __init__(self, out_dir=None, is_main=False, distributed=False):
        self.out_dir, self.is_main, self.distributed = out_dir, is_main, distributed
        self.received, self.previous, self.phase, self.wakeup = None, {}, "start-up", None
        self.next_step, self.stop_after = None, None  # next_step(): where a signal now stops; the received one's

    @contextlib.contextmanager
    def training(self, next_step):
        self.phase, self.next_step = "training", next_step
        try:
            yield
        finally:
            self.phase, self.next_step = "ended", None  # it holds the loop, whose model must go before the backend

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
            if not self.distributed:
                read, write = os.pipe()
                os.set_blocking(write, False)
                self.wakeup = signal.set_wakeup_fd(write)
                threading.Thread(target=self.second_ctrl_c, args=(read,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None and self.distributed:
            return
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.wakeup is not None:
            os.close(signal.set_wakeup_fd(self.wakeup))  # the watching thread reads its end and ends

    def handle(self, signum, frame):
        if self.phase == "start-up":
            raise KeyboardInterrupt
        if self.received is None:
            self.received, self.stop_after = signum, self.next_step() if self.phase == "training" else None
            if self.phase == "training" and self.is_main and self.out_dir:
                print(f"\n{signal.Signals(signum).name}: stopping after iter {self.stop_after}, then saving "
                      f"{os.path.join(self.out_dir, run_folder.CKPT)}", file=sys.stderr, flush=True)

    def second_ctrl_c(self, fd):
        # the wakeup fd hears each signal: handle() runs between bytecodes, which a C call holds off for seconds
        with os.fdopen(fd, "rb", buffering=0) as heard:
            count = 0
            while byte := heard.read(1):
                count += byte[0] in STOP_SIGNALS
                if count > 1 and byte[0] == signal.SIGINT:
                    print(f"\nsecond Ctrl-C: stopping at once; {saved_so_far(self.out_dir)}", file=sys.stderr,
                          flush=True)
                    os._exit(128 + signal.SIGINT)


def saved_so_far(out_dir):
    intact = intact_in(out_dir) if out_dir else []
    return f"intact: {', '.join(intact)}" if intact else f"nothing is saved in {out_dir} yet"


@contextlib.contextmanager
def run_ending(out_dir, go_on, proc):
    """train.py's ending in one line, by an error or a stop signal; `go_on`: the command that continues the run."""
    with (one_line_errors(out_dir, go_on, proc.distributed),
          StopSignals(out_dir, proc.is_main, proc.distributed) as signals):
        yield signals


@contextlib.contextmanager
def one_line_errors(out_dir=None, go_on=None, distributed=False):
    """An entry point's one error ladder: each error ends in one line, naming the rank under torchrun. An unexpected
    one keeps its traceback: in a run's `out_dir` (error.log, named in the line), else on stderr."""
    rank = os.environ.get("RANK")
    where = f" (rank {rank})" if rank else ""
    try:
        yield
    except KeyboardInterrupt:
        print(f"interrupted{where}", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Exception as e:
        said = expected_error(e, out_dir, go_on, distributed)
        if said is None and out_dir is None:
            raise
        line, status = said or (f"{error_line(e)}{traceback_kept(out_dir, where)}", 1)
        # the unexpected under torchrun on a line of its own, whatever another rank's progress bar left unended
        print(f"{chr(10) * bool(where and not said)}error{where}: {line}", file=sys.stderr)
        sys.exit(status)


def expected_error(e, out_dir, go_on, distributed):
    """(the line, the exit status) of an error the user can act on, with what out_dir keeps, else None."""
    if isinstance(e, DiskFull) and out_dir:
        intact = intact_in(out_dir)
        return f"{e}; {kept(intact)}" + (f": {run_folder.GO_ON}" if intact else ""), 2
    if isinstance(e, UserError):
        return str(e), 2
    if out_of_memory(e):
        return first_line(e), 1
    if distributed and lost_peer(e):  # this rank cannot save: its collectives have no peer
        intact = intact_in(out_dir) if out_dir else []
        resumable = any(path.startswith(f"{os.path.join(out_dir, run_folder.CKPT)} (") for path in intact)
        return (f"another rank of this run is gone ({error_line(e)}); {kept(intact)}"
                + (f"; continue with: {go_on}" if resumable else ": start the run again")), 2
    if out_dir and FORKED_CUDA in str(e):  # notebook_launcher's forked workers (accelerate issue 3524)
        return ("CUDA cannot start in a process forked from this notebook: train with the notebook's torchrun cell "
                "(python -m torch.distributed.run ... train.py) instead of notebook_main"), 1
    return None


def kept(intact):
    # read only where the line names them: loading each checkpoint is no work for a settings error
    return f"intact: {', '.join(intact)}" if intact else "no checkpoint was written yet"


def lost_peer(e):
    """Whether another rank is gone: torch.distributed's error types; gloo's are RuntimeErrors from its transport."""
    return isinstance(e, torch.distributed.DistError) or (
        type(e) is RuntimeError and "/gloo/transport/" in first_line(e))


def traceback_kept(out_dir, where):
    log = os.path.join(out_dir, run_folder.ERROR_LOG)
    try:
        with open(log, "a") as f:  # one write: ranks append to one file
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}{where}:\n{traceback.format_exc()}\n")
        return f" (traceback in {log})"
    except OSError:
        traceback.print_exc()
        return ""


@contextlib.contextmanager
def quiet_launcher_logs():
    """A failed worker has printed its line: the launcher's loggers would add the launcher's own traceback."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def notebook_launch(main, argv, num_processes, port):
    """main(argv) in processes forked by Accelerate's notebook_launcher, where no cell may have used CUDA."""
    from accelerate import notebook_launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    with one_line_errors():
        load_config(argv)  # a mistake in the arguments ends here, before any process starts
        if torch.cuda.is_initialized():
            raise UserError("CUDA was already initialised in this notebook (a cell used the GPU), and processes "
                            "forked from it cannot use CUDA: restart the kernel and call notebook_main first")
        try:
            with quiet_launcher_logs():
                notebook_launcher(main, ([*argv, "--backend=accelerate"],), num_processes=num_processes,
                                  use_port=str(port))
        except torch.distributed.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            raise UserError(f"port {port} is in use, probably by the processes of an earlier launch that are "
                            f"still running: restart the kernel, or pass port=<another port>") from None
        except ChildFailedError as e:  # each worker printed its own one-line error above
            if all(failure.exitcode == 2 for failure in e.failures.values()):
                sys.exit(2)  # a user error: nothing to add to the workers' lines
            failed = ", ".join(str(rank) for rank in sorted(e.failures))
            raise UserError(f"training failed in rank(s) {failed}: see the error line(s) above") from None
        except (ValueError, RuntimeError) as e:  # Accelerate's own checks of the notebook's state
            if not any(s in str(e) for s in ("should only be initialized inside", "has been initialized before")):
                raise
            raise UserError(f"{first_line(e)} (restart the kernel and call notebook_main first)") from None


def process_age():
    """Seconds since this process started (Linux's /proc), else 0."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: start, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def out_of_memory(error):
    """An allocation failure, a GPU's or the host's (under `ulimit -v` torch's CPU allocator raises a RuntimeError)."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: " in str(error))


@contextlib.contextmanager
def out_of_memory_hint(doing, settings):
    """An out-of-memory error inside says, in one line, what ran out of memory and the settings to lower."""
    try:
        yield
    except Exception as e:
        if not out_of_memory(e) or str(e).startswith("out of memory while"):  # already said by an inner hint
            raise
        detail = first_line(e)
        raise torch.OutOfMemoryError(f"out of memory while {doing}: lower {settings}"
                                     + (f" ({detail})" if detail else "")) from None


def training_memory_hint(cfg, proc):
    n, reduce_once = cfg.micro_batch_size, getattr(proc.parallel, "reduce_once", False)
    model = "--n_layer, --n_embd" if cfg.init_from == "scratch" else f"--init_from, now {cfg.init_from}"
    lower = (f"--micro_batch_size (now {n}; batch_size stays, with more accumulation steps)" if n > 1 else
             f"--block_size (now {cfg.block_size}) or the model's size ({model})"  # one row: what is left
             + ("" if cfg.lora_rank else " or set --lora_rank=8 (train adapters only)"))
    return out_of_memory_hint(f"training on micro-batches of {n} sequence{'s' * (n > 1)}", lower
                              + ("" if cfg.gradient_checkpointing else " or set --gradient_checkpointing=True")
                              + (" or set --fsdp_reduce_once=False (it keeps the weights gathered and the "
                                 "gradients unsharded)" if reduce_once is True else ""))
