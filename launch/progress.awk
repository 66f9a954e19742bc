# Condenses verl's console output (launch/run.sh pipes train.log through it) to one line per
# training step plus checkpoint/resume events. Input lines may carry Ray prefixes and colours.
BEGIN {
  n = split("reward/mean actor/grad_norm actor/kl_loss rollout/searches_mean response_length/mean timing_s/step", keys, " ")
}
/step:[0-9]+ - / {
  match($0, /step:[0-9]+ - /)
  m = split(substr($0, RSTART), parts, " - ")
  out = parts[1]
  for (k = 1; k <= n; k++)
    for (i = 2; i <= m; i++)
      if (index(parts[i], keys[k] ":") == 1) { out = out "  " parts[i]; break }
  print out
  fflush()
  next
}
/Training from scratch|Resuming from |Saving checkpoint to / {
  line = $0
  sub(/.*INFO:[^:]*:[^:]*:[^:]*:/, "", line)
  print "  " line
  fflush()
}
