"""The base layer: what every stage needs and nothing stage-specific.

User-facing errors, guarded file reads and atomic writes, streamed outputs, kernel locks, the device and precision
picker, the table formatter and the validated command-line flag types. It imports nothing else from dpr_gc, so any
layer may use it.
"""
