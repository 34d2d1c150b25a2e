//! The charts of small synthetic run folders.

use std::path::{Path, PathBuf};

use plotters::style::RGBColor;

use super::read::{self, Span};
use super::style::PALETTE;
use super::*;

/// `#RRGGBB`, as plotters' SVG backend writes colours.
fn hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// The elements `<tag ...>` of `svg` whose attribute `attr` is `colour`.
fn count(svg: &str, tag: &str, attr: &str, colour: RGBColor) -> usize {
    let want = format!("{attr}=\"{}\"", hex(colour));
    svg.lines()
        .filter(|l| l.starts_with(&format!("<{tag} ")) && l.contains(&want))
        .count()
}

/// Checks that `svg` is one `<svg>` element whose tags nest properly.
fn assert_well_formed(svg: &str) {
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
    assert!(svg.trim_end().ends_with("</svg>"));
    let mut open: Vec<&str> = Vec::new();
    for tag in svg.split('<').skip(1) {
        let tag = tag.split('>').next().unwrap_or_default();
        let name = |t: &str| t.split_whitespace().next().unwrap_or_default().to_string();
        if let Some(closing) = tag.strip_prefix('/') {
            assert_eq!(open.pop().map(name), Some(name(closing)), "{tag}");
        } else if !tag.ends_with('/') {
            open.push(tag);
        }
    }
    assert!(open.is_empty(), "unclosed: {open:?}");
    assert!(!svg.contains("NaN") && !svg.contains("inf"));
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("scratch file");
    path
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).expect("chart")
}

const METRICS: &str = r#"{"step":1,"loss":10.5,"lr":0.001,"tokens_per_s":900.0}
{"step":2,"loss":8.25,"tokens_per_s":1200.5}

{"step":3,"loss":null,"tokens_per_s":1180.0}
{"step":4,"loss":6.0,"val_loss":6.5,"tokens_per_s":1210.0,"expert_tokens":[[3,1],[2,2]]}
{"step":5,"loss":5.5,"tokens_per_s":1190.0,"expert_tokens":[[2,2],[4,0]]}
{"step":8,"loss":4.0,"val_loss":4.75,"tokens_per_s":1205.0}
"#;

const MEMORY_JSON: &str = r#"{"schedule":"1f1b","ranks":[
  {"rank":0,"pp_rank":0,"stages":[0],"recompute_units":[0],"peak_rss_mib":812.5,"max_in_flight":2},
  {"rank":1,"pp_rank":1,"stages":[1],"recompute_units":[1],"peak_rss_mib":640.0,"max_in_flight":1}]}"#;

/// A two-rank trace: per rank forwards, backwards, sends/receives, idle gaps and metadata.
const TRACE: &str = r#"{"traceEvents":[
  {"name":"process_name","ph":"M","pid":0,"tid":0,"args":{"name":"pipeline"}},
  {"name":"thread_name","ph":"M","pid":0,"tid":1,"args":{"name":"rank 1"}},
  {"name":"Forward(mb=0, stage=0)","cat":"forward","ph":"X","ts":0,"dur":1000,"pid":0,"tid":0},
  {"name":"Send","cat":"send","ph":"X","ts":1000,"dur":100,"pid":0,"tid":0},
  {"name":"Recv","cat":"recv","ph":"X","ts":1000,"dur":150,"pid":0,"tid":1},
  {"name":"Forward(mb=0, stage=1)","cat":"forward","ph":"X","ts":1150,"dur":900,"pid":0,"tid":1},
  {"name":"Backward(mb=0, stage=1)","cat":"backward","ph":"X","ts":2050,"dur":1800,"pid":0,"tid":1},
  {"name":"idle","cat":"idle","ph":"X","ts":1100,"dur":2900,"pid":0,"tid":0},
  {"name":"Backward(mb=0, stage=0)","cat":"backward","ph":"X","ts":4000,"dur":2000,"pid":0,"tid":0},
  {"name":"OptimizerStep","cat":"optimizer","ph":"X","ts":6000,"dur":300,"pid":0,"tid":0}
]}"#;

#[test]
fn a_full_run_folder_gets_all_five_charts() {
    let scratch = tempfile::tempdir().expect("scratch dir");
    let out = scratch.path().join("run-a");
    std::fs::create_dir(&out).expect("run folder");
    write(&out, "metrics.jsonl", METRICS);
    write(&out, "memory.json", MEMORY_JSON);
    let trace = write(scratch.path(), "trace.json", TRACE);

    let charts = write_charts(&out, Some(&trace)).expect("charts");
    let paths: Vec<PathBuf> = FILES.iter().map(|f| out.join(f)).collect();
    assert_eq!(
        charts.iter().map(|c| c.path.clone()).collect::<Vec<_>>(),
        paths
    );
    for path in &paths {
        assert_well_formed(&read(path));
    }

    let loss = read(&out.join(LOSS));
    assert!(loss.contains("Loss (run-a)") && loss.contains(">\ntraining\n</text>"));
    assert!(loss.contains(">\nvalidation\n</text>"));
    assert_eq!(count(&loss, "polyline", "stroke", PALETTE[0]), 1);
    assert_eq!(count(&loss, "polyline", "stroke", PALETTE[1]), 1);
    assert_eq!(
        count(&loss, "circle", "fill", PALETTE[1]),
        2,
        "a dot per validation"
    );
    assert!(!loss.contains("no data"));

    let throughput = read(&out.join(THROUGHPUT));
    assert!(throughput.contains("tokens/s") && throughput.contains("mean 1148 tokens/s"));
    assert_eq!(count(&throughput, "polyline", "stroke", PALETTE[2]), 1);

    let memory = read(&out.join(MEMORY));
    assert!(memory.contains("schedule 1f1b") && memory.contains("812.5 MiB"));
    assert!(memory.contains("rank 0") && memory.contains("rank 1"));
    assert_eq!(
        count(&memory, "rect", "fill", memory::BAR),
        2,
        "a bar per rank"
    );

    let timeline = read(&out.join(TIMELINE));
    assert!(timeline.contains("rank 0") && timeline.contains("rank 1"));
    assert!(timeline.contains("time (ms)"));
    // One rectangle per action and one legend swatch per category; idle spans are not drawn.
    for (category, actions) in [
        ("forward", 2),
        ("backward", 2),
        ("send", 1),
        ("recv", 1),
        ("optimizer", 1),
    ] {
        let colour = timeline::categories(&[Span {
            rank: 0,
            category: category.into(),
            start_us: 0.0,
            dur_us: 0.0,
        }])[0]
            .1;
        assert!(
            timeline.contains(&format!(">\n{category}\n</text>")),
            "{category}"
        );
        assert_eq!(
            count(&timeline, "rect", "fill", colour),
            actions + 1,
            "{category}"
        );
    }
    assert!(!timeline.contains("idle") && !timeline.contains("recompute"));
}

#[test]
fn missing_optional_inputs_skip_their_charts() {
    let out = tempfile::tempdir().expect("scratch dir");
    write(out.path(), "metrics.jsonl", METRICS);
    let absent = out.path().join("no-trace.json");
    let charts = write_charts(out.path(), Some(&absent)).expect("charts");
    let names: Vec<&str> = charts.iter().map(|c| c.what).collect();
    assert_eq!(names, ["loss curve", "throughput", "expert balance"]);
    assert!(!out.path().join(MEMORY).exists() && !out.path().join(TIMELINE).exists());
    // Without validation losses there is one loss series; a dense model has no balance.
    write(out.path(), "metrics.jsonl", r#"{"step":1,"loss":2.0}"#);
    let charts = write_charts(out.path(), None).expect("charts");
    assert_eq!(charts.len(), 2, "{charts:?}");
    let loss = read(&charts[0].path);
    assert_eq!(count(&loss, "polyline", "stroke", PALETTE[0]), 1);
    assert!(!loss.contains("validation"));
    assert_well_formed(&loss);
}

#[test]
fn a_malformed_metrics_line_is_named() {
    let out = tempfile::tempdir().expect("scratch dir");
    let path = write(
        out.path(),
        "metrics.jsonl",
        "{\"step\":1,\"loss\":2}\n\nnot json {\n",
    );
    let e = write_charts(out.path(), None).expect_err("a malformed line");
    assert!(
        matches!(&e, PlotError::Line { path: p, line: 3, .. } if *p == path),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains(&path.display().to_string()) && text.contains("line 3"),
        "{text}"
    );
    // A record without a step is malformed too; a missing file is an error naming it.
    write(out.path(), "metrics.jsonl", r#"{"loss":2.0}"#);
    let e = write_charts(out.path(), None).expect_err("no step");
    assert!(e.to_string().contains("line 1"), "{e}");
    std::fs::remove_file(&path).expect("removed");
    let e = write_charts(out.path(), None).expect_err("no metrics");
    assert!(matches!(e, PlotError::Read { .. }) && e.to_string().contains("metrics.jsonl"));
}

#[test]
fn malformed_optional_inputs_are_named() {
    let out = tempfile::tempdir().expect("scratch dir");
    write(out.path(), "metrics.jsonl", METRICS);
    let memory = write(out.path(), "memory.json", r#"{"ranks": 3}"#);
    let e = write_charts(out.path(), None).expect_err("bad memory.json");
    assert!(e.to_string().contains(&memory.display().to_string()), "{e}");
    std::fs::remove_file(&memory).expect("removed");
    for bad in ["{\"traceEvents\": 1}", "[{\"ph\": \"X\"", "42"] {
        let trace = write(out.path(), "t.json", bad);
        let e = write_charts(out.path(), Some(&trace)).expect_err("bad trace");
        assert!(
            matches!(&e, PlotError::Parse { path, .. } if *path == trace),
            "{e:?}"
        );
    }
}

#[test]
fn empty_inputs_give_charts_that_say_no_data() {
    let out = tempfile::tempdir().expect("scratch dir");
    write(out.path(), "metrics.jsonl", "");
    write(out.path(), "memory.json", r#"{"ranks": []}"#);
    let trace = write(out.path(), "trace.json", r#"{"traceEvents": []}"#);
    let charts = write_charts(out.path(), Some(&trace)).expect("charts");
    assert_eq!(charts.len(), 4);
    for chart in &charts {
        let svg = read(&chart.path);
        assert_well_formed(&svg);
        assert!(svg.contains("no data"), "{}", chart.what);
        assert!(
            PALETTE
                .iter()
                .all(|&c| count(&svg, "polyline", "stroke", c) == 0)
        );
    }
}

#[test]
fn odd_values_and_names_stay_finite_and_escaped() {
    let scratch = tempfile::tempdir().expect("scratch dir");
    let out = scratch.path().join("a<b&c");
    std::fs::create_dir(&out).expect("run folder");
    let huge = r#"{"step":1,"loss":1e308,"tokens_per_s":-1e308}
{"step":2,"loss":-1e308,"tokens_per_s":0}"#;
    write(&out, "metrics.jsonl", huge);
    for chart in write_charts(&out, None).expect("charts") {
        let svg = read(&chart.path);
        assert_well_formed(&svg);
        assert!(svg.contains("a&lt;b&amp;c"));
    }
    write(
        &out,
        "metrics.jsonl",
        r#"{"step":7,"loss":3.0,"val_loss":3.0}"#,
    );
    let loss = read(&write_charts(&out, None).expect("charts")[0].path);
    assert_well_formed(&loss);
    assert_eq!(
        count(&loss, "circle", "fill", PALETTE[0]),
        1,
        "a lone point shows"
    );
}

#[test]
fn long_timelines_show_their_latest_actions() {
    let spans: Vec<Span> = (0..timeline::MAX_SPANS + 10)
        .map(|i| Span {
            rank: (i % 3) as u64,
            category: if i % 2 == 0 { "forward" } else { "custom" }.into(),
            start_us: i as f64 * 1000.0,
            dur_us: 900.0,
        })
        .collect();
    let svg = timeline::chart("long", &spans).expect("chart");
    assert_well_formed(&svg);
    assert!(svg.contains(&format!("last {} of {}", timeline::MAX_SPANS, spans.len())));
    assert!(svg.contains("time (s)") && svg.contains(">\ncustom\n</text>"));
    let drawn: usize = timeline::categories(&spans)
        .iter()
        .map(|&(_, c)| count(&svg, "rect", "fill", c) - 1)
        .sum();
    assert_eq!(drawn, timeline::MAX_SPANS);
}

/// The `attr` values of the elements `<tag ...>` of `svg` whose `fill` is `colour`.
fn attr_of(svg: &str, tag: &str, colour: RGBColor, attr: &str) -> Vec<i64> {
    let fill = format!("fill=\"{}\"", hex(colour));
    let key = format!(" {attr}=\"");
    svg.lines()
        .filter(|l| l.starts_with(&format!("<{tag} ")) && l.contains(&fill))
        .filter_map(|l| l.split(&key).nth(1)?.split('"').next()?.parse().ok())
        .collect()
}

#[test]
fn a_single_rank_gets_one_full_row_and_one_bar() {
    let memory: read::MemoryReport =
        serde_json::from_str(r#"{"ranks":[{"rank":0,"peak_rss_mib":42.0}]}"#).expect("json");
    let svg = memory::chart("one", &memory).expect("chart");
    assert_well_formed(&svg);
    let widths = attr_of(&svg, "rect", memory::BAR, "width");
    assert!(
        widths.len() == 1 && (20..=120).contains(&widths[0]),
        "{widths:?}"
    );
    assert!(attr_of(&svg, "rect", memory::BAR, "height")[0] > 100);
    assert!(svg.contains("rank 0") && !svg.contains("rank 1"));

    let spans = [Span {
        rank: 0,
        category: "forward".into(),
        start_us: 5.0,
        dur_us: 10.0,
    }];
    let svg = timeline::chart("one", &spans).expect("chart");
    assert_well_formed(&svg);
    let heights = attr_of(&svg, "rect", PALETTE[0], "height");
    // The legend swatch, then the action spanning the whole row.
    assert_eq!(heights.len(), 2);
    assert!(heights[1] > 200, "{heights:?}");
    assert!(attr_of(&svg, "rect", PALETTE[0], "width")[1] > 700);
}
