// Usage history charts (uPlot, from npm), drawn from GET /usage/history.
//  - fleet: the top N users (most throttled or busiest) as a share of their limit;
//  - one user: tokens/s against that user's limit.
// Buckets with no report are gaps (an engine that disconnected), never zeros; limit
// changes are marked with a dashed vertical line in the user's colour.

import { api } from "./api.js";
import { fmtInt, fmtRateUnit, h } from "./dom.js";
import { link } from "./router.js";

export const TOP_N = 8;
export const RANGES = {
  "15m": [900, 60, "15 min"],
  "1h": [3600, 60, "1 h"],
  "24h": [86400, 600, "24 h"],
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

const Y_SHARE = "% of the user's limit";
const Y_RATE = "output tokens/s";
const hhmm = (s) =>
  new Date(s * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });

export function historyChart({
  user = null,
  range = "1h",
  order = "throttled",
  onRange = null,
} = {}) {
  const state = { range, order };
  const plotBox = h("div", { class: "chart", role: "img", "aria-label": "usage chart" });
  const summary = h("div", { class: "chart-summary" });
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
  );
  let plot = null;
  let marks = [];
  let observer = null;

  function size() {
    const width = Math.max(260, plotBox.clientWidth || 600);
    return { width, height: width < 500 ? 220 : 280 };
  }

  function draw(opts, data) {
    if (plot) plot.destroy();
    plot = new uPlot({ ...size(), ...opts, plugins: [markerPlugin(() => marks)] }, data, plotBox);
    if (!observer) {
      observer = new ResizeObserver(() => {
        if (plot) plot.setSize(size());
      });
      observer.observe(plotBox);
    }
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
    plotBox.dataset.points = String(times.length);
    const users = data.items.map((s) => s.user);
    const colour = colours(users);
    marks = [];
    const rows = [];
    if (user) {
      const s = data.items[0] || {
        output_tokens_per_second: times.map(() => null),
        limit: times.map(() => null),
        tokens: 0,
        throttled: 0,
      };
      const limits = s.limit.map((l, i) => (s.output_tokens_per_second[i] === null ? null : l));
      for (const m of limitChanges(s.output_tokens_per_second, s.limit))
        marks.push({ x: times[m.i], colour: "#6b7280" });
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
            { label: "limit", stroke: "#6b7280", dash: [6, 4], width: 1.5, spanGaps: false },
          ],
          axes: [{}, { label: Y_RATE, size: 60 }],
          scales: {
            x: { time: true },
            y: { range: (_u, _min, max) => [0, Math.max(1, max * 1.1)] },
          },
        },
        [times, s.output_tokens_per_second, limits],
      );
      plotBox.setAttribute(
        "aria-label",
        `${user}: ${Y_RATE} against the limit over time, last ${RANGES[state.range][2]}`,
      );
      rows.push(
        h(
          "p",
          { class: "hint" },
          `${fmtInt(s.tokens)} tokens granted, ${fmtInt(s.throttled)} throttled request-steps ` +
            "in this range. Gaps: no engine reported this user then.",
        ),
      );
      for (const m of limitChanges(s.output_tokens_per_second, s.limit))
        rows.push(
          h(
            "p",
            { class: "hint" },
            `Limit changed at ${hhmm(times[m.i])}: ${fmtRateUnit(m.from)} → ${fmtRateUnit(m.to)}`,
          ),
        );
    } else {
      const series = [{}];
      const values = [times];
      for (const s of data.items) {
        const share = s.output_tokens_per_second.map((r, i) =>
          r === null || s.limit[i] === null ? null : Math.round((r / s.limit[i]) * 1000) / 10,
        );
        const plotted = share.some((v) => v !== null);
        const last = [...s.limit]
          .reverse()
          .find((_l, i, a) => s.output_tokens_per_second[a.length - 1 - i] !== null);
        for (const m of limitChanges(s.output_tokens_per_second, s.limit))
          marks.push({ x: times[m.i], colour: colour[s.user] });
        if (plotted) {
          series.push({
            label: s.user,
            stroke: colour[s.user],
            width: 2,
            spanGaps: false,
            points: { show: false },
            value: (_u, v) => (v == null ? "–" : `${v}%`),
          });
          values.push(share);
        }
        const total = s.tokens + s.throttled;
        rows.push(
          h(
            "tr",
            { dataset: { user: s.user } },
            h(
              "td",
              {},
              h("span", {
                class: "swatch",
                style: `background:${colour[s.user]}`,
                "aria-hidden": "true",
              }),
              h("a", { href: link("users", s.user) }, s.user),
            ),
            h("td", {}, fmtRateUnit(last === undefined ? null : last)),
            h("td", {}, total ? `${Math.round((s.throttled / total) * 100)}%` : "0%"),
            h("td", {}, plotted ? "" : "unlimited: not plotted"),
          ),
        );
      }
      draw(
        {
          series,
          axes: [{}, { label: Y_SHARE, size: 60, values: (_u, vals) => vals.map((v) => `${v}%`) }],
          scales: {
            x: { time: true },
            y: {
              range: (_u, _min, max) => [0, Math.max(110, Math.ceil((max || 0) / 10) * 10 + 10)],
            },
          },
        },
        values,
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
          "Gaps: no engine reported the user then (e.g. an engine disconnected). " +
            "Dashed lines: limit changes.",
        ),
      );
    }
    plotBox.dataset.series = String(plot.series.length - 1);
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
                    { class: "compact" },
                    h("caption", { class: "visually-hidden" }, "users in the chart"),
                    h(
                      "thead",
                      {},
                      h(
                        "tr",
                        {},
                        ["User", "Limit", "Throttled", ""].map((t) => h("th", { scope: "col" }, t)),
                      ),
                    ),
                    h("tbody", {}, rows.slice(1)),
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
    },
  };
}
