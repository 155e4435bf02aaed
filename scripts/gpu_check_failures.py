"""pytest plugin of ``gpu_check.sh`` step d: each failed test on one line the moment it fails, so that a
step cut off by its time limit still names what failed (pytest's own summary comes only at the end)."""


def pytest_runtest_logreport(report):
    # With pytest-xdist this runs in the controller too, once per report a worker sends.
    if report.failed:
        lines = report.longreprtext.strip().splitlines()
        print(f"\nFAILED {report.nodeid} ({report.when}): {lines[-1][:300] if lines else ''}", flush=True)
