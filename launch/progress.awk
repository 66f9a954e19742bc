# Condenses verl's console output (launch/run.sh pipes train.log through it) to the study's
# metrics per training step (docs/metrics.md), three lines a step, plus checkpoint/resume events
# and the trainer's retriever warnings (steps with failed searches, the retriever-down stop).
# Input lines may carry Ray prefixes and colours.
BEGIN {
  groups[1] = "reward/mean reward/em reward/f1 reward/acc actor/grad_norm actor/entropy actor/kl_loss timing_s/step"
  groups[2] = "rollout/searches_mean rollout/retrieval_failures rollout/abort_ratio rollout/length_clip_ratio rollout/model_tokens_mean rollout/retrieved_tokens_mean"
  groups[3] = "rollout/termination/answer rollout/termination/turn_cap rollout/termination/length_cap rollout/termination/error grpo/group_reward_std_mean grpo/zero_variance_group_frac"
}
function pick(line_keys, parts, m,    keys, n, k, i, out) {
  n = split(line_keys, keys, " ")
  out = ""
  for (k = 1; k <= n; k++)
    for (i = 2; i <= m; i++)
      if (index(parts[i], keys[k] ":") == 1) { out = out "  " parts[i]; break }
  return out
}
/step:[0-9]+ - / {
  match($0, /step:[0-9]+ - /)
  m = split(substr($0, RSTART), parts, " - ")
  print parts[1] pick(groups[1], parts, m)
  print "       " pick(groups[2], parts, m)
  print "       " pick(groups[3], parts, m)
  fflush()
  next
}
/Training from scratch|Resuming from |Saving checkpoint to / {
  line = $0
  sub(/.*INFO:[^:]*:[^:]*:[^:]*:/, "", line)
  print "  " line
  fflush()
}
/WARNING: step [0-9]+: .* searches failed against |ERROR: retriever down: / {
  line = $0
  sub(/^.*(WARNING|ERROR): /, "", line)
  print "  " line
  fflush()
}
