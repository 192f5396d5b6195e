"""Runs Python test modules with unittest and ends with one summary line.

    run_tests.py test_env test_api ...

Output ends with 'N passed, N failed, N skipped' (and a GoogleTest-style
'[  PASSED  ] N tests.' line before it, which scripts/test-summary counts).
Exit status 0 only when nothing failed.
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(names):
    suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    print("[  PASSED  ] %d tests." % passed)
    if failed:
        print("[  FAILED  ] %d tests, listed below:" % failed)
        for test, _ in result.failures + result.errors:
            print("[  FAILED  ] %s" % test.id())
    if skipped:
        print("[  SKIPPED ] %d tests, listed below:" % skipped)
        for test, why in result.skipped:
            print("[  SKIPPED ] %s (%s)" % (test.id(), why))
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
