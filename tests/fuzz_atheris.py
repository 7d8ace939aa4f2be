"""Coverage-guided fuzzing of ``tests/support/fuzz_target.py`` with atheris, where it is installed.

    pip install atheris
    python -m tests.fuzz_atheris tests/fuzz_corpus -max_total_time=300

New inputs atheris finds are written to the corpus directory given; an input
that breaks an invariant is saved by atheris as ``crash-*``: add it to
``tests/fuzz_corpus/`` (as ``NAME.ndjson``) so ``tests/test_fuzz.py`` replays
it on every run. CI runs the hypothesis budget instead (atheris is not a
dependency of the project).
"""

from __future__ import annotations

import sys


def main() -> None:
    import atheris

    with atheris.instrument_imports():
        from tests.support import fuzz_target

    atheris.Setup(sys.argv, fuzz_target.run)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
