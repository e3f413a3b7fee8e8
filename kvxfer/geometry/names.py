"""The names of the supported dtypes and layout presets, without torch: command lines list them in their
help without importing it (``kvxfer --help`` stays fast). ``kvxfer.geometry.layout`` holds what they name
(a test checks the two agree)."""

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
PRESET_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "flash_attn", "flashinfer_nhd",
                "flashinfer_hnd", "flash_attn_cross_layer")
