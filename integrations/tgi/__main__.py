"""`python -m paged_backend.tgi [TGI launcher flags]`: the same as `paged-backend launch`."""

from paged_backend.tgi.launcher.launch import main

main(prog="python -m paged_backend.tgi")
