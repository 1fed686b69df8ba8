"""Test-only: Python imports this at start-up in every process with this folder on PYTHONPATH
(tests/fault_injection.py puts it there); `pypto_faults` then installs the faults the
environment names, and does nothing when it names none."""

import pypto_faults

pypto_faults.install()
