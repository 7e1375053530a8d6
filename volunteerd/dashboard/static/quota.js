// The limits form's note on a quota set below what the daemon's upkeep alone moves: the
// DHT, identify and pings reaching a joined daemon count in the quotas (0.39 GB a day in
// a 6-node test swarm serving nothing) and go on after a quota is used up, so a smaller
// quota is used up without serving a call. A warning: the quota is set all the same.
// As `volunteerd limit` warns (cli.py: _upkeep_gb_a_day, _quota_warnings).

// What upkeep moves when the stats have too few idle hours to tell (docs/volunteer.md).
export const UPKEEP_FLOOR_GB_A_DAY = 0.5;
export const UPKEEP_FLOOR_GB_A_MONTH = 15;
const UPKEEP_MIN_HOURS = 3;

/** GB a day by the daemon's own count: the median of the whole hours in ``stats``
 * (a /stats answer) in which it served no expert call and moved anything, times 24 (an
 * hour of replica averaging is not upkeep); null with fewer than three of them or no
 * stats. ``now`` in Unix seconds. */
export function upkeepGbADay(stats, now) {
  const idle = (stats?.history ?? []).filter((b) => b.size_s === 3600 && b.start + b.size_s <= now
    && b.forward + b.backward === 0)
    .map((b) => (b.bytes_sent ?? 0) + (b.bytes_received ?? 0))
    .filter((moved) => moved > 0)
    .sort((x, y) => x - y);
  if (idle.length < UPKEEP_MIN_HOURS) return null;
  const mid = Math.floor(idle.length / 2);
  const median = idle.length % 2 ? idle[mid] : (idle[mid - 1] + idle[mid]) / 2;
  return median * 24 / 1e9;
}

/** The warnings for ``limits`` (a /limits answer): a daily or monthly quota below what
 * upkeep moves, ``upkeep`` GB a day (``upkeepGbADay``) or, when null, the floor. */
export function quotaWarnings(limits, upkeep, fmt = String) {
  const [day, month] = upkeep == null ? [UPKEEP_FLOOR_GB_A_DAY, UPKEEP_FLOOR_GB_A_MONTH] : [upkeep, upkeep * 30];
  const measured = upkeep == null
    ? `a joined daemon's upkeep moves about ${fmt(day)} GB a day`
    : `this daemon's upkeep moved ${fmt(Number(day.toPrecision(2)))} GB a day while it served nothing`;
  const out = [];
  for (const [quota, needed, name] of [[limits.daily_quota_gb, day, "daily"], [limits.monthly_quota_gb, month, "monthly"]]) {
    if (quota > 0 && quota < needed) {
      out.push(`The ${name} quota of ${fmt(quota)} GB is below what upkeep alone uses (${measured}): `
        + "it may be used up without serving a call, and upkeep goes on after it.");
    }
  }
  return out;
}
