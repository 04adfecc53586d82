"""pytest plugin (`-p fa_select`) that picks the cases of flash-attn's test files to run against
cuflash: head dims, dtypes and a seeded fraction from the environment (tools/flash_attn_tests.py sets
them), and leaves out the tests of flash-attn's private entry points. What it left out, and why,
goes to the JSON file CUFLASH_FA_SUMMARY names (written by each process that collects: under
pytest-xdist the workers, which all collect the same cases)."""
import json
import os
import zlib

# Tests that call flash-attn's private C++ entry points (flash_attn_gpu.*, _flash_attn_varlen_forward).
PRIVATE = {
    "test_flash_attn_varlen_paged_kv_num_splits": "calls _flash_attn_varlen_forward",
    "test_flash_attn_generator_arg_must_be_none": "calls flash_attn_gpu's C++ entry points",
}
# Tests of behaviour where cuflash differs from flash-attn on purpose (docs/flash_attn_tests.md).
DIFFERS = {
    "test_flash_attn_kvcache_paged_block_table_bounds":
        "expects device cache_seqlens checked on the host; cuflash clamps them on the device",
}
# The file's dtype parameters by name (str of a torch dtype: this plugin loads without torch).
_DTYPES = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}


def pytest_collection_modifyitems(config, items):
    headdims = {int(d) for d in os.environ.get("CUFLASH_FA_HEADDIMS", "64,128").split(",")}
    dtypes = {_DTYPES[name] for name in os.environ.get("CUFLASH_FA_DTYPES", "fp16,bf16").split(",")}
    fraction = float(os.environ.get("CUFLASH_FA_FRACTION", "1"))
    kept, dropped, left_out = [], [], {}
    for item in items:
        name = item.originalname if hasattr(item, "originalname") else item.name
        params = item.callspec.params if hasattr(item, "callspec") else {}
        reason = None
        if name in PRIVATE or name in DIFFERS:
            reason = PRIVATE.get(name) or DIFFERS[name]
        elif "d" in params and params["d"] not in headdims:
            reason = "head dim not chosen"
        elif "dtype" in params and str(params["dtype"]) not in dtypes:
            reason = "dtype not chosen"
        elif zlib.crc32(item.nodeid.rsplit("/", 1)[-1].encode()) % 10_000 >= fraction * 10_000:
            reason = "outside the sample"
        if reason:
            left_out[reason] = left_out.get(reason, 0) + 1
            dropped.append(item)
        else:
            kept.append(item)
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)
    summary = os.environ.get("CUFLASH_FA_SUMMARY")
    if summary:
        with open(summary, "w") as f:
            json.dump({"chosen": len(kept), "left out": left_out}, f)
