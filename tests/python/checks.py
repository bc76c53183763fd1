"""What the Python client checks (tests/python/*_client.py) share: the assertion helper and the loop
that runs the checks in order and reports each one. The scripts import it from their own folder
(Python puts a script's folder first on the module path)."""

import sys


def check(cond, what):
    """Raises AssertionError(what) unless cond holds."""
    if not cond:
        raise AssertionError(what)


def run_checks(checks, describe=str):
    """Runs each (function, args) of `checks` in order, a failure not stopping the rest; prints
    `ok   NAME` or `FAIL NAME: describe(error)` for each and `N passed, M failed` at the end, then
    exits with status 1 when any failed, else 0."""
    passed = failed = 0
    for t, args in checks:
        try:
            t(*args)
            passed += 1
            print(f"ok   {t.__name__}")
        except Exception as e:  # report every check
            failed += 1
            print(f"FAIL {t.__name__}: {describe(e)}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
