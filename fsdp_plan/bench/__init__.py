"""``fsdp-plan bench``: real runs of a plan (``worker``), one session's flow (``session``) and
the result files that let reruns be compared (``results``)."""
