"""Pictures made from a plan and its measurements (the last stage: nothing here decides a plan).

- ``series``: memory over one step of a plan (the memory model's own sweep, on the clock's
  time axis), and a measured step's curve lined up with it;
- ``snapshot``: the same step as an allocation timeline in the format of
  ``torch.cuda.memory._snapshot()`` (``--memory-snapshot``), predicted or measured;
- ``page``: what a page shows, gathered as plain data; ``html``: the page itself (``--html``,
  the optional ``html`` extra: plotly);
- ``files``: the ``--html`` / ``--memory-snapshot`` options and files of every verb.
"""
