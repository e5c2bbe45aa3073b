"""Errors a user can act on: each names the problem and the fix, so the CLI can print one
paragraph instead of a traceback from deep inside torch."""


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of an exception's message (torch and transformers put pages below it)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else (default or type(exc).__name__)


def ran_out_of_memory(exc: BaseException) -> bool:
    """torch's allocator error, or a kernel launcher's: Triton raises a RuntimeError ('Triton Error
    [CUDA]: out of memory') when an autotuning launch finds no room (an 8B pair at batch 16 on one
    H200, bench/RESULTS.md, twenty-seventh session)."""
    return type(exc).__name__ == "OutOfMemoryError" or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


OUT_OF_MEMORY_FIX = ("Make the work smaller or give it more memory: apply takes --set calibrate.batch_size=N and --set align.batch_size=N "
                     "(windows per forward) or --offload-layers; distill --micro-batch N or --grad-checkpoint; eval --batch-size N; "
                     "or run on a device with more free memory (--device).")


class SurgeryError(Exception):
    """Base class: `problem` says what is wrong, `fix` what to do about it."""

    def __init__(self, problem: str, fix: str = ""):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} {fix}".strip())


class ModelLoadError(SurgeryError):
    """The model source could not be read (path, GGUF, config, missing package)."""


class CaptureError(SurgeryError):
    """torch.export could not trace the model, or the graph cannot take an input."""


class NoAttentionError(SurgeryError):
    """The graph holds no attention that this toolkit can find."""


class SiteError(SurgeryError):
    """An attention site was found but one of its parts could not be resolved."""


class PassConfigError(SurgeryError):
    """A pass was given a config it cannot honour (bad layer, bad ratio, unknown key)."""


class PassOrderError(SurgeryError):
    """Passes were composed in an order whose requirements are not met."""


class PassFailedError(SurgeryError):
    """A pass raised while running; the message names it and what ran before."""


class CheckpointError(SurgeryError):
    """A saved hybrid is missing, corrupt, or does not match its recipe."""


class OutputBusyError(SurgeryError):
    """Another live process is writing the same output directory (it holds the directory's lock)."""


class CalibrationError(SurgeryError):
    """Calibration data or statistics are unusable (empty text, NaN statistics)."""


class DecodeError(SurgeryError):
    """The graph cannot be decoded incrementally with exact results, or a decoding call is out of bounds."""


class DataError(SurgeryError):
    """Text or training data is missing, empty, or too short for one sequence."""


class DistillError(SurgeryError):
    """A distillation run cannot start or continue (bad config, model, data or output directory)."""


class ExportError(SurgeryError):
    """A hybrid cannot be written in the asked format (an attention module the format cannot swap, an unknown format)."""


class EvalTaskError(SurgeryError):
    """An evaluation task cannot run: a task name no shipped task has, or lm-eval missing."""
