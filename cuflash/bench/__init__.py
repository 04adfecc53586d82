"""Benchmarks behind `python -m cuflash bench`: cuflash against naive CuPy, torch SDPA and JAX's cuDNN attention.

The top layer: imported by the command line only, never by the runtime
package (`import cuflash` loads none of it). It uses cuflash's public API,
`cuflash.dispatch`'s heuristic_only and the timer in `cuflash.timing`.

options   option spellings shared with the other commands (no heavy imports)
shapes    the benchmark's problems: 16k tokens, hidden 2048; their FLOPs
variants  the attention options (--window, --softcap, --alibi, --dropout) and the visible-entry count
inputs    random inputs and dtypes
libs      the timed implementations behind one interface
naive     unfused attention in CuPy (the naive baseline and fallback reference)
checks    correctness of outputs and gradients (only finite, with dropout)
measure   timing a row's libraries, device facts, logging
memory    peak extra memory of one call
forward   the forward benchmark's rows
fwd_bwd   the forward+backward benchmark's rows
fp8       the fp8 benchmark (--fp8)
tables    the printed tables and the JSON report
cli       `python -m cuflash bench`: its options
run       the driver: check and time every shape, print the tables
"""
