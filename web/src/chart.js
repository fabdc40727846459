// Usage history charts (uPlot, from npm), drawn from GET /usage/history.
//  - fleet: the top N users (most throttled or busiest) as a share of the limit in force
//    during each part of each bucket (the server weighs it: a bucket spanning a limit
//    change is not divided by the new limit), and the fleet's total tokens/s;
//  - one user: tokens/s against the limit in force.
// Lines differ by colour and dash pattern and are labelled at their ends; the table
// under the chart gives each line's latest value (and, for a shadow limit, the share of
// request-steps it would have throttled) without hovering, and "Values per bucket"
// lists every drawn value. Buckets with no report are gaps (an engine that
// disconnected), never zeros; limit changes are marked with a dashed vertical line in
// the user's colour. The current minute is over the seconds reported so far, not a dip.

import { api, userPath } from "./api.js";
import { fmtInt, h } from "./dom.js";
import { link } from "./router.js";

export const TOP_N = 8;
// range -> [seconds, step, label]; 7 days of 10-minute buckets is 1,008 points (the
// server answers at most 1,440).
export const RANGES = {
  "15m": [900, 60, "15 min"],
  "1h": [3600, 60, "1 h"],
  "24h": [86400, 600, "24 h"],
  "7d": [7 * 86400, 600, "7 days"],
};
// Distinguishable colours (Tableau 10); a user keeps its colour while the page is open.
const PALETTE = [
  "#4e79a7",
  "#f28e2b",
  "#e15759",
  "#76b7b2",
  "#59a14f",
  "#edc948",
  "#b07aa1",
  "#ff9da7",
  "#9c755f",
  "#79706e",
];
// With the colour, each line's own dash pattern (in CSS px): told apart in grey too.
const DASHES = [[], [10, 4], [2, 3], [12, 3, 2, 3], [5, 5], [2, 7], [8, 2, 2, 2, 2, 2], [16, 6]];
const assigned = new Map();

function hash(text) {
  let x = 2166136261;
  for (let i = 0; i < text.length; i++) x = Math.imul(x ^ text.charCodeAt(i), 16777619) >>> 0;
  return x;
}

// Stable: the same user keeps its colour across refreshes; no two shown users share one.
export function colours(users) {
  const used = new Set();
  const result = {};
  for (const user of users) {
    let c = assigned.get(user);
    if (c === undefined || used.has(c)) {
      c = hash(user) % PALETTE.length;
      while (used.has(c) && used.size < PALETTE.length) c = (c + 1) % PALETTE.length;
      assigned.set(user, c);
    }
    used.add(c);
    result[user] = PALETTE[c];
  }
  return result;
}

// Buckets where the limit differs from the last reported bucket (gaps have no limit).
function limitChanges(rates, limits) {
  const marks = [];
  let last;
  limits.forEach((limit, i) => {
    if (rates[i] === null) return;
    if (last !== undefined && limit !== last) marks.push({ i, from: last, to: limit });
    last = limit;
  });
  return marks;
}

const lastIndex = (values) => {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return i;
  return -1;
};

function markerPlugin(getMarks) {
  return {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          ctx.save();
          ctx.setLineDash([4, 4]);
          ctx.lineWidth = 1.5 * devicePixelRatio;
          for (const { x, colour } of getMarks()) {
            const px = u.valToPos(x, "x", true);
            ctx.strokeStyle = colour;
            ctx.beginPath();
            ctx.moveTo(px, u.bbox.top);
            ctx.lineTo(px, u.bbox.top + u.bbox.height);
            ctx.stroke();
          }
          ctx.restore();
        },
      ],
    },
  };
}

// CSS px from the plot's right edge to the end labels (the leaders run between).
const LABEL_GAP = 14;

// Each line's name at its last drawn point, in the right margin, pushed apart so that
// lines ending close together (eight users at 94-98 %) keep readable labels.
function endLabelPlugin(getLabels) {
  return {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          const px = devicePixelRatio;
          const gap = 13 * px;
          const labels = getLabels()
            .map(({ series, text, colour }) => {
              const values = u.data[series];
              const i = lastIndex(values);
              if (i < 0) return null;
              const y = u.valToPos(values[i], "y", true);
              return { y, at: y, text, colour };
            })
            .filter(Boolean)
            .sort((a, b) => a.y - b.y);
          const top = u.bbox.top + gap / 2;
          const bottom = u.bbox.top + u.bbox.height;
          for (let i = 0; i < labels.length; i++)
            labels[i].y = Math.max(labels[i].y, i ? labels[i - 1].y + gap : top);
          for (let i = labels.length - 1; i >= 0; i--)
            labels[i].y = Math.min(
              labels[i].y,
              i < labels.length - 1 ? labels[i + 1].y - gap : bottom,
            );
          ctx.save();
          ctx.font = `${11 * px}px system-ui, sans-serif`;
          ctx.textBaseline = "middle";
          ctx.textAlign = "left";
          const edge = u.bbox.left + u.bbox.width;
          const x = edge + LABEL_GAP * px;
          ctx.lineWidth = px;
          for (const { y, at, text, colour } of labels) {
            // A leader from the line's end to its label, where the label was pushed away:
            // grey, dotted and outside the plot, so it never reads as the line's last step
            // (a coloured slope there looked like the current minute dipping).
            if (Math.abs(y - at) >= px) {
              ctx.strokeStyle = "#9aa0a6";
              ctx.setLineDash([2 * px, 2 * px]);
              ctx.beginPath();
              ctx.moveTo(edge + 2 * px, at);
              ctx.lineTo(x - 2 * px, y);
              ctx.stroke();
              ctx.setLineDash([]);
            }
            ctx.fillStyle = colour;
            ctx.fillText(text, x, y);
          }
          ctx.restore();
        },
      ],
    },
  };
}

// A legend swatch: the line's colour and dash pattern.
function swatch(colour, dash) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", "28");
  svg.setAttribute("height", "8");
  svg.setAttribute("aria-hidden", "true");
  svg.classList.add("dash");
  const line = document.createElementNS(ns, "line");
  for (const [k, v] of Object.entries({ x1: 0, y1: 4, x2: 28, y2: 4, stroke: colour })) {
    line.setAttribute(k, String(v));
  }
  line.setAttribute("stroke-width", "2.5");
  if (dash.length) line.setAttribute("stroke-dasharray", dash.join(" "));
  svg.append(line);
  return h(
    "span",
    { class: "legend-key" },
    h("span", { class: "swatch", style: `background:${colour}`, "aria-hidden": "true" }),
    svg,
  );
}

const Y_SHARE = "% of the user's limit";
const Y_RATE = "output tokens/s";
const hhmm = (s) =>
  new Date(s * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
const stamp = (s, step) =>
  step >= 600
    ? new Date(s * 1000).toLocaleString([], {
        month: "short",
        day: "numeric",
        hour: "2-digit",
        minute: "2-digit",
      })
    : hhmm(s);
const pct = (share) => (share === null ? null : Math.round(share * 1000) / 10);
const fmtPct = (v) => (v === null || v === undefined ? "–" : `${v}%`);
const fmtTok = (v) => (v === null || v === undefined ? "–" : `${v.toFixed(1)} tok/s`);
const fmtLimit = (v) =>
  v === null || v === undefined
    ? "unlimited"
    : `${Number.isInteger(v) ? fmtInt(v) : v.toFixed(1)} tok/s`;

export function historyChart({
  user = null,
  range = "1h",
  order = "throttled",
  onRange = null,
} = {}) {
  const state = { range, order };
  const plotBox = h("div", { class: "chart", role: "img", "aria-label": "usage chart" });
  const summary = h("div", { class: "chart-summary" });
  const fleetPlotBox = h("div", {
    class: "fleet-chart",
    role: "img",
    "aria-label": "the fleet's output tokens/s over time",
  });
  const fleetLatest = h("p", { class: "hint", id: "fleet-history-latest" });
  const valuesBox = h("div", { class: "table-wrap" });
  const values = h(
    "details",
    {
      class: "chart-values",
      ontoggle: () => {
        if (values.open && lastData) valuesBox.replaceChildren(valuesTable(lastData));
      },
    },
    h("summary", {}, "Values per bucket (table)"),
    valuesBox,
  );
  const rangeButtons = Object.entries(RANGES).map(([key, [, , label]]) =>
    h(
      "button",
      {
        type: "button",
        class: "secondary",
        "aria-pressed": String(key === state.range),
        dataset: { range: key },
        onclick: () => {
          state.range = key;
          for (const b of rangeButtons)
            b.setAttribute("aria-pressed", String(b.dataset.range === key));
          if (onRange) onRange(key);
          refresh();
        },
      },
      label,
    ),
  );
  const orderSelect = user
    ? null
    : h(
        "select",
        {
          "aria-label": "which users",
          onchange: (e) => {
            state.order = e.target.value;
            refresh();
          },
        },
        h("option", { value: "throttled" }, `${TOP_N} most throttled users`),
        h("option", { value: "tokens" }, `${TOP_N} busiest users`),
      );
  if (orderSelect) orderSelect.value = state.order;
  const el = h(
    "div",
    { class: "history" },
    h(
      "div",
      { class: "row", role: "group", "aria-label": "time range" },
      h("span", { class: "hint" }, "Time range:"),
      rangeButtons,
      orderSelect,
    ),
    plotBox,
    summary,
    values,
    user
      ? null
      : h(
          "div",
          { class: "fleet-history" },
          h("h3", {}, "Fleet total: output tokens/s"),
          fleetPlotBox,
          fleetLatest,
        ),
  );
  let plot = null;
  let fleetPlot = null;
  let marks = [];
  let labels = [];
  let observer = null;
  let lastData = null;

  function size(box) {
    const width = Math.max(260, box.clientWidth || 600);
    return { width, height: width < 500 ? 220 : 280 };
  }

  function draw(opts, data) {
    if (plot) plot.destroy();
    const box = size(plotBox);
    // Room on the right for the labels at the lines' ends: their gap, about 6.5 px a
    // character at 11 px and 10 px to spare; at most a third of the width.
    const longest = Math.max(0, ...labels.map((l) => l.text.length));
    const room = Math.min(Math.round(box.width / 3), LABEL_GAP + 10 + Math.ceil(6.5 * longest));
    plot = new uPlot(
      {
        ...box,
        padding: [12, room, 0, 0],
        ...opts,
        plugins: [markerPlugin(() => marks), endLabelPlugin(() => labels)],
      },
      data,
      plotBox,
    );
    if (!observer) {
      observer = new ResizeObserver(() => {
        if (plot) plot.setSize(size(plotBox));
        if (fleetPlot) fleetPlot.setSize({ ...size(fleetPlotBox), height: 160 });
      });
      observer.observe(plotBox);
    }
  }

  function drawFleet(times, rates) {
    if (fleetPlot) fleetPlot.destroy();
    fleetPlot = new uPlot(
      {
        ...size(fleetPlotBox),
        height: 160,
        legend: { show: false }, // the latest value is written under it
        series: [
          {},
          {
            label: "fleet tok/s",
            stroke: "#1d2330",
            width: 2,
            spanGaps: false,
            points: { show: false },
          },
        ],
        axes: [{}, { label: Y_RATE, size: 60 }],
        scales: { x: { time: true }, y: { range: (_u, _min, max) => [0, Math.max(1, max * 1.1)] } },
      },
      [times, rates],
      fleetPlotBox,
    );
  }

  // Every drawn value, per bucket: the lines read without the canvas.
  function valuesTable(data) {
    const { times, step, items } = data;
    const shown = items.filter((s) => s.share_of_limit.some((v) => v !== null));
    const headers = user
      ? ["Bucket", "tok/s", "Limit in force", "% of limit", "Would throttle"]
      : ["Bucket", ...shown.map((s) => s.user), "Fleet tok/s"];
    const rows = [];
    times.forEach((t, i) => {
      if (user) {
        const s = items[0];
        if (!s || s.output_tokens_per_second[i] === null) return;
        rows.push(
          h(
            "tr",
            { dataset: { time: String(t) } },
            h("td", {}, stamp(t, step)),
            h("td", {}, fmtTok(s.output_tokens_per_second[i])),
            h("td", {}, fmtLimit(s.limit[i])),
            h(
              "td",
              { dataset: { share: String(pct(s.share_of_limit[i])) } },
              fmtPct(pct(s.share_of_limit[i])),
            ),
            h("td", {}, fmtPct(pct(s.would_throttle_fraction[i]))),
          ),
        );
        return;
      }
      const fleet = data.fleet.output_tokens_per_second[i];
      if (fleet === null && shown.every((s) => s.share_of_limit[i] === null)) return;
      rows.push(
        h(
          "tr",
          { dataset: { time: String(t) } },
          h("td", {}, stamp(t, step)),
          shown.map((s) =>
            h(
              "td",
              { dataset: { user: s.user, share: String(pct(s.share_of_limit[i])) } },
              fmtPct(pct(s.share_of_limit[i])),
            ),
          ),
          h("td", { dataset: { fleet: String(fleet) } }, fmtTok(fleet)),
        ),
      );
    });
    return h(
      "table",
      { class: "compact", id: "chart-values" },
      h("caption", { class: "visually-hidden" }, "chart values per bucket"),
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          headers.map((t) => h("th", { scope: "col" }, t)),
        ),
      ),
      h("tbody", {}, rows),
    );
  }

  async function enforcementOf(users) {
    const views = await Promise.all(users.map((u) => api("GET", userPath(u)).catch(() => null)));
    return Object.fromEntries(users.map((u, i) => [u, views[i]?.effective_enforcement]));
  }

  async function refresh() {
    const [seconds, step] = RANGES[state.range];
    const params = new URLSearchParams({
      since: new Date(Date.now() - seconds * 1000).toISOString(),
      step: String(step),
    });
    if (user) params.set("user", user);
    else {
      params.set("top", String(TOP_N));
      params.set("order", state.order);
    }
    const data = await api("GET", `/usage/history?${params}`);
    const times = data.times;
    const users = data.items.map((s) => s.user);
    const [modes] = await Promise.all([enforcementOf(users)]);
    lastData = data;
    plotBox.dataset.points = String(times.length);
    const colour = colours(users);
    const dash = Object.fromEntries(users.map((u, i) => [u, DASHES[i % DASHES.length]]));
    marks = [];
    labels = [];
    const rows = [];
    if (user) {
      const s = data.items[0] || {
        output_tokens_per_second: times.map(() => null),
        limit: times.map(() => null),
        share_of_limit: times.map(() => null),
        would_throttle_fraction: times.map(() => null),
        limited_fraction: times.map(() => null),
        tokens: 0,
        throttled: 0,
        would_throttle: 0,
      };
      const rates = s.output_tokens_per_second;
      const limits = s.limit.map((l, i) => (rates[i] === null ? null : l));
      for (const m of limitChanges(rates, s.limit))
        marks.push({ x: times[m.i], colour: "#6b7280" });
      labels = [
        { series: 1, text: "tok/s", colour: colour[user] || PALETTE[0] },
        { series: 2, text: "limit", colour: "#6b7280" },
      ];
      draw(
        {
          series: [
            {},
            {
              label: `${user} tok/s`,
              stroke: colour[user] || PALETTE[0],
              width: 2,
              spanGaps: false,
            },
            {
              label: "limit in force",
              stroke: "#6b7280",
              dash: [6, 4],
              width: 1.5,
              spanGaps: false,
            },
          ],
          axes: [{}, { label: Y_RATE, size: 60 }],
          scales: {
            x: { time: true },
            y: { range: (_u, _min, max) => [0, Math.max(1, max * 1.1)] },
          },
        },
        [times, rates, limits],
      );
      plotBox.setAttribute(
        "aria-label",
        `${user}: ${Y_RATE} against the limit in force over time, last ${RANGES[state.range][2]}`,
      );
      const i = lastIndex(rates);
      const shadow = modes[user] === "shadow";
      rows.push(
        h(
          "p",
          { id: "chart-latest" },
          i < 0
            ? "No usage reported in this range."
            : `Latest (${hhmm(times[i])}): ${fmtTok(rates[i])}, ` +
                (s.share_of_limit[i] === null
                  ? "unlimited"
                  : `${fmtPct(pct(s.share_of_limit[i]))} of the limit in force ` +
                    `(${fmtLimit(s.limit[i])}${shadow ? ", shadow: not enforced" : ""})`) +
                (shadow ? `; would throttle ${fmtPct(pct(s.would_throttle_fraction[i]))}` : "") +
                ".",
        ),
        h(
          "p",
          { class: "hint" },
          `${fmtInt(s.tokens)} tokens granted, ${fmtInt(s.throttled)} throttled request-steps ` +
            "in this range. Gaps: no engine reported this user then.",
        ),
      );
      for (const m of limitChanges(rates, s.limit))
        rows.push(
          h(
            "p",
            { class: "hint" },
            `Limit changed at ${hhmm(times[m.i])}: ${fmtLimit(m.from)} → ${fmtLimit(m.to)}`,
          ),
        );
    } else {
      const series = [{}];
      const plotted = [times];
      for (const s of data.items) {
        const share = s.share_of_limit.map(pct);
        const drawn = share.some((v) => v !== null);
        const shadow = modes[s.user] === "shadow";
        for (const m of limitChanges(s.output_tokens_per_second, s.limit))
          marks.push({ x: times[m.i], colour: colour[s.user] });
        if (drawn) {
          series.push({
            label: s.user,
            stroke: colour[s.user],
            dash: dash[s.user],
            width: 2,
            spanGaps: false,
            points: { show: false },
            value: (_u, v) => (v == null ? "–" : `${v}%`),
          });
          plotted.push(share);
          labels.push({
            series: series.length - 1,
            text: shadow ? `${s.user} (shadow)` : s.user,
            colour: colour[s.user],
          });
        }
        const i = lastIndex(share);
        const total = s.tokens + s.throttled;
        const wouldRange = total ? Math.min(1, s.would_throttle / total) : 0;
        const partly = i >= 0 && s.limited_fraction[i] !== null && s.limited_fraction[i] < 1;
        rows.push(
          h(
            "tr",
            { dataset: { user: s.user, shadow: String(shadow) } },
            h(
              "td",
              {},
              swatch(colour[s.user], dash[s.user]),
              h("a", { href: link("users", s.user) }, s.user),
              shadow ? h("span", { class: "pill shadow" }, "shadow") : null,
            ),
            h(
              "td",
              { class: "latest", dataset: { share: String(i < 0 ? null : share[i]) } },
              i < 0 ? "–" : `${fmtPct(share[i])} (${fmtTok(s.output_tokens_per_second[i])})`,
            ),
            h("td", {}, fmtLimit(i < 0 ? null : s.limit[i])),
            h("td", {}, total ? `${Math.round((s.throttled / total) * 100)}%` : "0%"),
            h(
              "td",
              { class: "would" },
              shadow || s.would_throttle ? `${(wouldRange * 100).toFixed(1)}%` : "–",
            ),
            h(
              "td",
              {},
              drawn
                ? partly
                  ? "partly unlimited in the latest bucket"
                  : ""
                : "unlimited: not plotted",
            ),
          ),
        );
      }
      draw(
        {
          series,
          legend: { show: false }, // the table under the chart is the legend, with values
          axes: [{}, { label: Y_SHARE, size: 60, values: (_u, vals) => vals.map((v) => `${v}%`) }],
          scales: {
            x: { time: true },
            y: {
              range: (_u, _min, max) => [0, Math.max(110, Math.ceil((max || 0) / 10) * 10 + 10)],
            },
          },
        },
        plotted,
      );
      const ranked = state.order === "tokens" ? "busiest" : "most throttled";
      plotBox.setAttribute(
        "aria-label",
        `${Y_SHARE} of the ${TOP_N} ${ranked} users over time, last ${RANGES[state.range][2]}`,
      );
      rows.unshift(
        h(
          "p",
          { class: "hint" },
          "Share of the limit in force during each part of each bucket (a limit change " +
            "within a bucket is weighed by time). Gaps: no engine reported the user then " +
            "(e.g. an engine disconnected). Vertical dashed lines: limit changes.",
        ),
      );
      const fleet = data.fleet.output_tokens_per_second;
      drawFleet(times, fleet);
      const f = lastIndex(fleet);
      fleetLatest.textContent =
        f < 0
          ? "No usage reported in this range."
          : `Latest (${hhmm(times[f])}): ${fmtTok(fleet[f])}; ` +
            `${fmtInt(data.fleet.tokens)} tokens in this range.`;
    }
    plotBox.dataset.series = String(plot.series.length - 1);
    if (values.open) valuesBox.replaceChildren(valuesTable(data));
    summary.replaceChildren(
      ...(user
        ? rows
        : [
            rows[0],
            data.items.length
              ? h(
                  "div",
                  { class: "table-wrap" },
                  h(
                    "table",
                    { class: "compact stack-narrow", id: "chart-legend" },
                    h("caption", { class: "visually-hidden" }, "users in the chart"),
                    h(
                      "thead",
                      {},
                      h(
                        "tr",
                        {},
                        LEGEND_HEADERS.map((t) => h("th", { scope: "col" }, t)),
                      ),
                    ),
                    h(
                      "tbody",
                      {},
                      rows.slice(1).map((row) => {
                        [...row.children].forEach((td, i) => {
                          if (LEGEND_HEADERS[i]) td.dataset.label = LEGEND_HEADERS[i];
                        });
                        return row;
                      }),
                    ),
                  ),
                )
              : h("p", { class: "hint" }, "No usage reported in this range."),
          ]),
    );
  }

  return {
    el,
    refresh,
    destroy() {
      if (observer) observer.disconnect();
      if (plot) plot.destroy();
      if (fleetPlot) fleetPlot.destroy();
    },
  };
}

const LEGEND_HEADERS = ["User", "Latest", "Limit in force", "Throttled", "Would throttle", ""];
