"""A ``run`` request, from the parsed command line to the plan the ranks run: the run settings
as the command line and the matrix see them (``settings``), the request resolved once
(``run_request``: the preset, ``--ds-config`` (``ds_config``), the world size, the defaults
and the sizes derived from them) and every reason to refuse it before a rank starts
(``preflight``, with ``requirements``, ``gpu_memory``, ``time_floor`` and
``kernel_check``)."""
