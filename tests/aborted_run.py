"""A run that aborts in a thread of its own (as a C++ library's std::terminate would), for
tests/test_suite_hygiene.py: a zygote run killed by SIGABRT writes every thread's stack first.

    python -m tests.aborted_run
"""
import os
import threading


def abort_here():
    os.abort()


t = threading.Thread(target=abort_here, name="aborting")
t.start()
t.join()
