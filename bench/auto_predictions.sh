#!/usr/bin/env bash
# auto_predictions.sh: `gpipe train --schedule auto` (the default) on each built-in task, its
# predicted step and bubble against the measured ones, for docs/schedules.md.
#
# Each round runs every task once, in turn (a profile, then STEPS steps: the main job twice as
# many), so that the machine's moods fall on every task alike; the report gives, per task, the
# median over the rounds of measured / predicted with its min and max, and each round's choice.
#
# Usage: bench/auto_predictions.sh [ROUNDS] [STEPS]   (defaults 3 and 150)
#   RESULTS=FILE writes the results there instead of bench/results/auto-predictions.json
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
steps="${2:-150}"
out="${RESULTS:-bench/results/auto-predictions.json}"
tasks=(cnn resnet unet gpt)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq 1 "$rounds"); do
  for task in "${tasks[@]}"; do
    echo "round $round/$rounds: $task" >&2
    n=$steps
    [ "$task" != cnn ] || n=$((2 * steps))
    build/apps/gpipe train --model "$task" --steps "$n" --test-samples 64 --json >"$work/$task-$round.json" 2>/dev/null
  done
done

/usr/bin/python3 - "$work" "$rounds" "$steps" "$out" "${tasks[@]}" <<'PY'
import datetime, json, statistics, sys
work, rounds, steps, out, tasks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
rows = []
for task in tasks:
    runs = [json.load(open(f"{work}/{task}-{r}.json")) for r in range(1, rounds + 1)]
    per_round = [{"schedule": j["schedule"], "virtual_stages": j["virtual_stages"],
                  "micro_batches": j["micro_batches"], "balance": j["balance"],
                  "predicted_step_s": j["auto"]["predicted_step_s"], "measured_step_s": j["auto"]["measured_step_s"],
                  "measured_median_step_s": j["auto"].get("measured_median_step_s"),
                  "predicted_bubble": j["auto"]["predicted_bubble"], "measured_bubble": j["auto"]["measured_bubble"],
                  "samples_per_s": j["samples_per_s"]} for j in runs]
    ratios = [r["measured_step_s"] / r["predicted_step_s"] for r in per_round]
    row = {"task": task, "steps": runs[-1]["steps_this_run"], "measured_over_predicted": statistics.median(ratios),
           "measured_over_predicted_min": min(ratios), "measured_over_predicted_max": max(ratios),
           "per_round": per_round}
    rows.append(row)
    print(f"{task:7s} measured / predicted step {row['measured_over_predicted']:.3f} "
          f"({row['measured_over_predicted_min']:.3f} .. {row['measured_over_predicted_max']:.3f})")
    for r in per_round:
        print(f"          {r['schedule']} V={r['virtual_stages']} M={r['micro_batches']} {r['balance']}: "
              f"step {1e3 * r['predicted_step_s']:.1f} ms predicted, {1e3 * r['measured_step_s']:.1f} measured"
              + (f" (median {1e3 * r['measured_median_step_s']:.1f})" if r["measured_median_step_s"] else "") + "; "
              f"bubble {r['predicted_bubble']:.3f} predicted, {r['measured_bubble']:.3f} measured")
json.dump({"command": f"bash bench/auto_predictions.sh {rounds} {steps}",
           "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"), "rounds": rounds,
           "machine": runs[-1].get("machine"), "results": rows}, open(out, "w"), indent=2)
print(f"results written to {out}")
PY
