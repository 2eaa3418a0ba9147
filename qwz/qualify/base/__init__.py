"""The harness's base layer, what every layer above stands on: a run as data (``plan``: the
plan, its arms and every run setting's one declaration; ``values``: the rules a setting's
value follows; ``presets``: named sets of defaults), atomic files (``files``), one meaning
per exit status (``exit_codes``), the ranks' side channel (``rank_reports``) and the
supervisor of child processes (``supervise``). Nothing here imports another layer of the
harness."""
