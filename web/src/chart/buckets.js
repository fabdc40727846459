// Reading a history series bucket by bucket. A bucket with no report is null (a gap: an
// engine that disconnected), never a zero.

// The last bucket with a report, or -1.
export const lastIndex = (values) => {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return i;
  return -1;
};

// Buckets where the limit differs from the last reported bucket (gaps have no limit).
export function limitChanges(rates, limits) {
  const marks = [];
  let last;
  limits.forEach((limit, i) => {
    if (rates[i] === null) return;
    if (last !== undefined && limit !== last) marks.push({ i, from: last, to: limit });
    last = limit;
  });
  return marks;
}

// A user the history has no series for: every bucket a gap.
export function noSeries(times) {
  const gaps = () => times.map(() => null);
  return {
    output_tokens_per_second: gaps(),
    limit: gaps(),
    share_of_limit: gaps(),
    would_throttle_fraction: gaps(),
    limited_fraction: gaps(),
    tokens: 0,
    throttled: 0,
    would_throttle: 0,
  };
}
