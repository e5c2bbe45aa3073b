"""Library noise, filtered once when `surgery` starts (`--verbose` keeps it).

Filtered: deprecation notices (FutureWarning, DeprecationWarning, PendingDeprecationWarning, from
wherever they are attributed: torch's pytree notice points into the standard library's copyreg),
every warning raised inside torch, transformers, gguf, tqdm, accelerate or Triton (3.9's notice that its
FP-fusion default will change, once a process that compiles a kernel), transformers' own
logging below errors, and tqdm bars (transformers' GGUF conversion draws one on every load).
Surgery's own warnings (a compile that fell back to eager, a BOS mismatch) are UserWarnings raised
from surgery's modules and still show."""
from __future__ import annotations

import logging
import warnings

LIBRARIES = r"(torch|transformers|gguf|tqdm|accelerate|huggingface_hub|safetensors|triton)(\.|$)"
DEPRECATIONS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def quiet_libraries(verbose: bool) -> None:
    if verbose:
        return
    for category in DEPRECATIONS:
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", module=LIBRARIES)
    quiet_tqdm()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def quiet_tqdm() -> None:
    """tqdm bars off unless a caller asks for one by name (disable=False); TQDM_DISABLE would come
    too late, tqdm reads it when first imported."""
    import tqdm.std

    init = tqdm.std.tqdm.__init__
    if getattr(init, "quiet", False):
        return

    def quiet_init(self, *args, **kwargs):
        kwargs.setdefault("disable", True)
        init(self, *args, **kwargs)

    quiet_init.quiet = True
    tqdm.std.tqdm.__init__ = quiet_init
