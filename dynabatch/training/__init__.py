"""The training application, built on the pipeline engine (:mod:`dynabatch.engine`): the training loop
(:mod:`.trainer`), the step planner and its service ahead of the loop (:mod:`.planner`, :mod:`.plan_ahead`,
:mod:`.planner_process`), online calibration (:mod:`.calibration`), the start-up choice of layer split and
placement (:mod:`.run_layout`), evaluation, metrics and tracking, resuming and resharding checkpoints, and the
run's configuration with the one resolver of every ``auto`` (:mod:`.config`). :mod:`.workload` is the planning
path ``plan``, ``simulate`` and ``bench`` share over a configuration."""
