"""What this pytest session collected and selected, for fixtures that run a whole case script in a subprocess
(interpreter_runner.run_case_script): tests/conftest.py stores the collected node ids here, so that a module
fixture can tell a selection of its module's tests (the quick tier, `-k`) from all of them and run only the
cases the selected tests read."""

from __future__ import annotations

import pytest

COLLECTED_IDS = pytest.StashKey[list]()  # every collected node id, before -m / -k deselect
QUICK_IDS = pytest.StashKey[list]()  # the node ids marked `quick` (tests/quick.txt)
