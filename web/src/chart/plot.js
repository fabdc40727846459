// One uPlot (from npm, loaded by index.html) in a box: drawn anew on each refresh and
// resized with the box.

// size: (box) => {width, height}.
export function plotIn(box, size) {
  let plot = null;
  return {
    size: () => size(box),
    draw(options, data) {
      if (plot) plot.destroy();
      plot = new uPlot(options, data, box);
    },
    resize() {
      if (plot) plot.setSize(size(box));
    },
    numSeries: () => plot.series.length - 1,
    destroy() {
      if (plot) plot.destroy();
    },
  };
}
