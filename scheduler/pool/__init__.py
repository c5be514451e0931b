"""Cross-model autoscaling on a shared pool (seed 004): pure functions, no Django, no clock.

    twu.py        token-weighted utilisation from engine reports: per plan, per GPU, per deployment
    autoscale.py  the scale rule on TWU windows (`scale_signal`) and per-model soft limits
                  (`admission_shares`)
    sharing.py    GPUs shared by memory fraction: the snapshot one deployment decides on
                  (`shared_snapshot`, max_models_per_gpu) and the stores' reservation check
    priority.py   which lower-priority holder gives which GPUs to a higher one (`choose_givers`)
"""
