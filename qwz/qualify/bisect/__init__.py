"""``qwz-qualify bisect``: which commit of a repository under test made a qualification go bad.

The qualification is the oracle of a binary search over the first-parent history between a
good and a bad commit (``git bisect`` semantics: a commit that cannot be judged is skipped).
One file per job: ``first_parents`` (git: the commits, their subjects and diff stats),
``worktrees`` (each commit checked out under the bisect's directory, made importable, set
up), ``trial`` (one qualification of one commit, as a subprocess), ``oracle`` (good, bad or
skip from a record), ``search`` (the next commit to test, and the answer), ``state`` (the
request and every attempt on disk, so a bisect resumes), ``result`` (bisect.json and
bisect.md) and ``bisect_command`` (the two commands, ``bisect`` and ``bisect-step``).

[Note: the judge is the bisecting head's]
  Every commit is qualified by the same harness: the ``qwz/qualify`` package of the qwz that
  runs the bisect, copied once into ``<out>/harness/`` when the bisect starts. For qwz's own
  history the commit's worktree gets that copy in place of its own ``qwz/qualify`` (so the
  ranks run the commit's engine, optimizer, kernels and collectives, and today's runner,
  observers, spec and checks); for a DeepSpeed checkout the harness runs from the bisecting
  qwz with ``--deepspeed-src`` set to the worktree. Why not each commit's own harness: the
  verdict would then change wherever the harness changed (a new check, a fixed observer, a
  new record schema this qwz refuses to load), and a bisect would find the commit that
  changed the judge, not the one that changed the code under test. With one judge, the
  only thing that varies between two trials is the code under test, so a check that flips,
  a hash that changes or a speed-up that drops is that code's doing. The price: a commit
  whose core lacks something today's harness needs does not import, and is skipped (its
  reason is in bisect.md). The records say so honestly: their head is the commit's SHA,
  ``dirty`` with the diff digest of the swapped harness. A resumed bisect must use the same
  harness (its digest is in request.json), or the records it reuses would have been judged
  by another one.

[Note: records are the state]
  Everything a bisect learns is a file under ``<out>/commits/<sha>/attempt-<n>/``: the
  record the trial wrote, or ``outcome.json`` saying why it wrote none (setup failed, the
  commit did not import, the run was refused). The search is deterministic given those
  files, so a bisect started again over the same directory walks the same path, reuses every
  attempt it finds and runs only what is missing. An interrupted trial leaves neither (the
  run writes its record atomically, and an interrupted one only ``interrupted.json``, which
  is no record), so it is the one trial run again, over that file. Records do not depend on
  the oracle: a ``--hash`` bisect over the directory of a finished check bisect runs only
  the commits its own path adds.
"""
