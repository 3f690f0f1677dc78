"""Command lines: `python -m deepwell` (`report`, with the training `demo`) and
`python -m deepwell.cli.kernels --compile-all` (`kernels`)."""
