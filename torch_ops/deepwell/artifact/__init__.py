"""Inference artifacts: `deepwell.export` writes a trained engine's weights, plan and policy into a
directory, `deepwell.load` rebuilds the model from one without running code from it
(docs/DESIGN.md "Training, checkpoints and export").

| module | what |
|---|---|
| `export` | `export`, `load`, `planned_eager` |
| `quantized` | the pre-quantized linear layers an artifact's low-precision sites load into |
"""
