"""What every tutorial runs first, from any current directory (the project is installed by requirements.txt):

    from tutorials.notebook_setup import ROOT, quiet_outputs

    quiet_outputs()  # before the other imports

and, around a call that logs local paths (the notebooks that build their run with gndpo_minimal.setup):

    with paths_from_root():
        run = setup(args)

Nothing here is part of the algorithm: it keeps progress bars, harmless library warnings and local folders out of
the saved outputs, and names the repository root so that paths do not depend on where the notebook runs.
"""

import contextlib
import io
import logging
import os
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, above tutorials/


def quiet_outputs() -> None:
    """No progress bars and no warnings the reader cannot act on in a notebook's outputs. Call it before importing
    tqdm, transformers or gndpo_minimal: the progress-bar switches are read when those are imported."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in the saved outputs
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # nor transformers' weight-loading bar
    warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: harmless
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")  # a deprecation inside peft: harmless
    # On CPUs with AVX512-BF16, bitsandbytes logs at import that an optional kernel package is missing (or, with the
    # `kernels` package installed and the Hub offline, kernels logs that it skips a trust check); it then uses its
    # own kernels: harmless, and machine-dependent noise in the saved outputs.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    logging.getLogger("kernels").setLevel(logging.ERROR)
    import tqdm.auto
    import tqdm.std

    # main() draws its progress bar with tqdm.auto, which in a notebook is the widget bar, and the widget bar
    # ignores TQDM_DISABLE: hand it the plain bar, which honours it, so no frozen "0%" bar is saved with the outputs.
    tqdm.auto.tqdm = tqdm.std.tqdm


@contextlib.contextmanager
def paths_from_root():
    """What the block prints, with the repository root cut from the paths in it (setup() logs the checkpoints it
    loads): the saved outputs name no folder of the machine that ran the notebook."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        print(printed.getvalue().replace(ROOT + os.sep, ""), end="")
