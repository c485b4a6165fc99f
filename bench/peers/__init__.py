"""Benchmark harness for pinload and the loaders people use today (bench/run_peers.py,
bench/run_all.py). Not part of the pinload package; bench/ goes on sys.path.

    checkpoint  the files a path names, their headers, the reference digests
    page_cache  evict a set's files, read them once, measure what is cached
    adapters    one function per loader (SYSTEMS), and Skip
    convert     copies in the formats some peers need (tensorizer, .pt, flashpack)
    worker      the per-system worker process: timed steps, verify()
    harness     Scenario, run_system() in a fresh worker, measure() over repeats

The tables built from the results are in bench/report.py.
"""
