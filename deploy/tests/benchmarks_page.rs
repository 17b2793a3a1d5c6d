//! BENCHMARKS.md, the page of today's figures, against the repository:
//! - every table has a `record` column, and every row of it names a `.bench/` record or links a
//!   history file (`benchmarks/history/...`);
//! - every command quoted on the page exists: for `fission ...` and `fission-loadtest ...` the
//!   test walks the subcommands through `--help` (each must succeed) and finds every `--flag`
//!   of the command in the help of the binary or of a subcommand on its path; `cargo` commands
//!   name a package with that test, bench or example; scripts (`*.sh`, `*.py`) are files;
//! - every history link resolves, and every history file is linked from the page;
//! - links from the repository's other markdown files to `BENCHMARKS.md#anchor` name a heading.
//!
//! The checks are plain functions that return the problems they find, so the unit tests below
//! run them on a bad page and see each one fail.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const HISTORY_DIR: &str = "benchmarks/history/";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `fission-loadtest`, built beside `fission` by the workspace build (`deploy/test.sh`).
fn loadtest_bin() -> PathBuf {
    Path::new(FISSION)
        .parent()
        .unwrap()
        .join("fission-loadtest")
}

/// A markdown table: the line of its header (1-based), the header's cells and its rows.
struct Table {
    line: usize,
    header: Vec<String>,
    rows: Vec<(usize, Vec<String>)>,
}

/// The cells of a table row, split on `|` outside code spans.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let mut out = Vec::new();
    let mut cell = String::new();
    let mut in_code = false;
    for c in inner.chars() {
        match c {
            '`' => {
                in_code = !in_code;
                cell.push(c);
            }
            '|' if !in_code => out.push(std::mem::take(&mut cell).trim().to_string()),
            _ => cell.push(c),
        }
    }
    out.push(cell.trim().to_string());
    out
}

/// Lines with their 1-based numbers.
type Lines<'a> = Vec<(usize, &'a str)>;

/// Lines outside fenced code blocks, and the fenced lines apart.
fn split_fences(md: &str) -> (Lines<'_>, Lines<'_>) {
    let (mut prose, mut code) = (Vec::new(), Vec::new());
    let mut in_fence = false;
    for (i, line) in md.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        } else if in_fence {
            code.push((i + 1, line));
        } else {
            prose.push((i + 1, line));
        }
    }
    (prose, code)
}

fn is_separator(line: &str) -> bool {
    let c = cells(line);
    !c.is_empty()
        && c.iter().all(|cell| {
            let cell = cell.trim_matches(':');
            !cell.is_empty() && cell.chars().all(|ch| ch == '-')
        })
}

/// The tables outside code blocks: a run of lines that start with `|`, the first its header,
/// the second (when it is one) its separator.
fn tables(md: &str) -> Vec<Table> {
    let (prose, _) = split_fences(md);
    let mut out: Vec<Table> = Vec::new();
    let mut in_table = false;
    let mut i = 0;
    while i < prose.len() {
        let (n, line) = prose[i];
        let is_row = line.trim_start().starts_with('|');
        let contiguous = i > 0 && prose[i - 1].0 + 1 == n;
        if !is_row {
            in_table = false;
        } else if in_table && contiguous {
            out.last_mut().unwrap().rows.push((n, cells(line)));
        } else {
            out.push(Table {
                line: n,
                header: cells(line),
                rows: Vec::new(),
            });
            in_table = true;
            if prose.get(i + 1).is_some_and(|(_, l)| is_separator(l)) {
                i += 1;
            }
        }
        i += 1;
    }
    out
}

/// Rows that name no record, and tables without a `record` column.
fn record_problems(md: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for table in tables(md) {
        let Some(col) = table
            .header
            .iter()
            .position(|h| h.eq_ignore_ascii_case("record"))
        else {
            problems.push(format!(
                "line {}: a table without a `record` column",
                table.line
            ));
            continue;
        };
        for (line, row) in &table.rows {
            if row.len() != table.header.len() {
                problems.push(format!(
                    "line {line}: {} cells under a header of {}",
                    row.len(),
                    table.header.len()
                ));
                continue;
            }
            let record = &row[col];
            let names_record = record.contains("`.bench/")
                || record.contains(&format!("]({HISTORY_DIR}"))
                || record.contains(&format!("](./{HISTORY_DIR}"));
            if !names_record {
                problems.push(format!(
                    "line {line}: the row names no `.bench/` record or history file: {record:?}"
                ));
            }
        }
    }
    problems
}

/// The targets of links into the history folder, with their lines.
fn history_links(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in md.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].trim_start_matches("./");
            if target.starts_with(HISTORY_DIR) {
                out.push((n + 1, target.split('#').next().unwrap().to_string()));
            }
            rest = &after[end..];
        }
    }
    out
}

/// Links to history files that do not exist, and history files the page does not link.
fn history_problems(md: &str, root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let links = history_links(md);
    for (line, target) in &links {
        if !root.join(target).is_file() {
            problems.push(format!("line {line}: {target} does not exist"));
        }
    }
    let linked: BTreeSet<&str> = links.iter().map(|(_, t)| t.as_str()).collect();
    if let Ok(dir) = std::fs::read_dir(root.join(HISTORY_DIR)) {
        for entry in dir {
            let name = format!(
                "{HISTORY_DIR}{}",
                entry.unwrap().file_name().to_string_lossy()
            );
            if !linked.contains(name.as_str()) {
                problems.push(format!("{name} is not linked from the page"));
            }
        }
    }
    problems
}

/// Shell-like words: whitespace splits, quotes group (and are dropped).
fn words(command: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut started = false;
    for c in command.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                started = true;
            }
            (None, c) if c.is_whitespace() => {
                if started || !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
                started = false;
            }
            (None, c) => word.push(c),
        }
    }
    if started || !word.is_empty() {
        out.push(word);
    }
    out
}

/// The commands quoted on the page (code spans and fenced lines), as words without leading
/// `VAR=value` assignments, split at `&&`, `;` and `|`, without `#` comments. Only those that
/// start with a program this test knows: `fission`, `fission-loadtest`, `cargo`, `bash`, `sh`,
/// `python3`, or a path to a script.
fn commands(md: &str) -> Vec<Vec<String>> {
    let (prose, code) = split_fences(md);
    let text: String = prose.iter().map(|(_, l)| *l).collect::<Vec<_>>().join("\n");
    let mut snippets: Vec<String> = text
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|s| s.replace('\n', " "))
        .collect();
    snippets.extend(code.iter().map(|(_, l)| l.to_string()));
    let mut out = Vec::new();
    for snippet in snippets {
        let snippet = snippet.split(" #").next().unwrap().to_string();
        let mut current = Vec::new();
        for w in words(&snippet).into_iter().chain([";".to_string()]) {
            if w == "&&" || w == ";" || w == "|" || w == "||" {
                let cmd = std::mem::take(&mut current);
                if is_known_command(&cmd) {
                    out.push(cmd);
                }
                continue;
            }
            let is_assignment = current.is_empty()
                && w.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty()
                        && k.chars()
                            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                });
            if !is_assignment {
                current.push(w);
            }
        }
    }
    out
}

fn is_script(word: &str) -> bool {
    word.contains('/')
        && (word.ends_with(".sh") || word.ends_with(".py"))
        && !word.starts_with('$')
        && !word.starts_with('/')
}

fn is_known_command(cmd: &[String]) -> bool {
    match cmd.first().map(String::as_str) {
        Some("fission" | "fission-loadtest" | "cargo" | "bash" | "sh" | "python3") => true,
        Some(w) => is_script(w),
        None => false,
    }
}

/// Runs a binary's `--help` on a subcommand path, caching the answers.
struct Helps {
    cache: HashMap<(PathBuf, Vec<String>), Result<String, String>>,
}

impl Helps {
    fn help(&mut self, bin: &Path, path: &[String]) -> Result<String, String> {
        let key = (bin.to_path_buf(), path.to_vec());
        self.cache
            .entry(key)
            .or_insert_with(|| {
                let out = Command::new(bin)
                    .args(path)
                    .arg("--help")
                    .output()
                    .map_err(|e| format!("{} could not run: {e}", bin.display()))?;
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                if out.status.success() {
                    Ok(text)
                } else {
                    Err(format!(
                        "`{} {} --help` failed: {}",
                        bin.display(),
                        path.join(" "),
                        String::from_utf8_lossy(&out.stderr).trim()
                    ))
                }
            })
            .clone()
    }
}

/// The subcommands a clap help lists under `Commands:` (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| *w != "help")
        .map(str::to_string)
        .collect()
}

/// Whether `flag` (`--name`) is in `help` as a whole word.
fn help_has_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(at, _)| {
        let next = help[at + flag.len()..].chars().next();
        let before = help[..at].chars().next_back();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            && !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

/// A `fission` or `fission-loadtest` command: the subcommands it names, walked through
/// `--help`, and each of its flags in one of those helps.
fn cli_problems(helps: &mut Helps, bin: &Path, cmd: &[String]) -> Vec<String> {
    let shown = cmd.join(" ");
    let mut path: Vec<String> = Vec::new();
    let mut help = match helps.help(bin, &path) {
        Ok(h) => h,
        Err(e) => return vec![format!("`{shown}`: {e}")],
    };
    let mut all_help = help.clone();
    let mut rest = &cmd[1..];
    loop {
        let subs = subcommands(&help);
        let Some(at) = rest
            .iter()
            .position(|w| !w.starts_with('-') && subs.contains(w))
        else {
            break;
        };
        path.push(rest[at].clone());
        rest = &rest[at + 1..];
        help = match helps.help(bin, &path) {
            Ok(h) => h,
            Err(e) => return vec![format!("`{shown}`: {e}")],
        };
        all_help.push_str(&help);
    }
    let mut problems = Vec::new();
    let mut named = vec![cmd[0].clone()];
    named.extend(path.iter().cloned());
    let named = named.join(" ");
    // `Usage: fission bench <COMMAND>`: a subcommand is required here, and none was named.
    let needs_subcommand = help
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .is_some_and(|l| l.contains("<COMMAND>"));
    if needs_subcommand {
        problems.push(format!("`{shown}`: names no subcommand of `{named}`"));
    }
    for w in &cmd[1..] {
        if let Some(flag) = w.strip_prefix("--") {
            let flag = format!("--{}", flag.split('=').next().unwrap());
            if flag != "--help" && flag != "--" && !help_has_flag(&all_help, &flag) {
                problems.push(format!("`{shown}`: {flag} is not in the help of `{named}`"));
            }
        }
    }
    problems
}

/// The directory of the workspace package named `name`.
fn package_dir(root: &Path, name: &str) -> Option<PathBuf> {
    let wanted = format!("name = \"{name}\"");
    std::fs::read_dir(root).ok()?.find_map(|entry| {
        let dir = entry.ok()?.path();
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).ok()?;
        let package = manifest.split("[package]").nth(1)?;
        let first_name = package
            .lines()
            .find(|l| l.trim_start().starts_with("name"))?;
        (first_name.trim() == wanted).then_some(dir)
    })
}

/// A `cargo` command: its `-p` package exists, with the `--test`, `--bench` and `--example`
/// targets it names.
fn cargo_problems(root: &Path, cmd: &[String]) -> Vec<String> {
    let shown = cmd.join(" ");
    let args: Vec<&str> = cmd
        .iter()
        .map(String::as_str)
        .take_while(|w| *w != "--")
        .collect();
    let value_of = |flag: &str| -> Vec<&str> {
        args.windows(2)
            .filter(|p| p[0] == flag)
            .map(|p| p[1])
            .collect()
    };
    let mut problems = Vec::new();
    let packages = value_of("-p");
    let packages = if packages.is_empty() {
        value_of("--package")
    } else {
        packages
    };
    for package in &packages {
        let Some(dir) = package_dir(root, package) else {
            problems.push(format!("`{shown}`: no package {package} in the workspace"));
            continue;
        };
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        for (flag, folder) in [
            ("--test", "tests"),
            ("--bench", "benches"),
            ("--example", "examples"),
        ] {
            for target in value_of(flag) {
                let exists = dir.join(folder).join(format!("{target}.rs")).is_file()
                    || dir.join(folder).join(target).join("main.rs").is_file()
                    || manifest.contains(&format!("name = \"{target}\""));
                if !exists {
                    problems.push(format!("`{shown}`: {package} has no {flag} {target}"));
                }
            }
        }
    }
    problems
}

/// Every problem with the commands quoted on a page.
fn command_problems(md: &str, root: &Path, helps: &mut Helps) -> Vec<String> {
    let mut problems = Vec::new();
    for cmd in commands(md) {
        let shown = cmd.join(" ");
        match cmd[0].as_str() {
            "fission" => problems.extend(cli_problems(helps, Path::new(FISSION), &cmd)),
            "fission-loadtest" => {
                let bin = loadtest_bin();
                if bin.is_file() {
                    problems.extend(cli_problems(helps, &bin, &cmd));
                } else {
                    problems.push(format!(
                        "`{shown}`: {} is not built (cargo build --release -p loadtest)",
                        bin.display()
                    ));
                }
            }
            "cargo" => problems.extend(cargo_problems(root, &cmd)),
            _ => {
                let scripts: Vec<&String> = cmd.iter().filter(|w| is_script(w)).collect();
                if scripts.is_empty() {
                    problems.push(format!("`{shown}`: runs no script of the repository"));
                }
                for script in scripts {
                    if !root.join(script).is_file() {
                        problems.push(format!("`{shown}`: {script} is not a file"));
                    }
                }
            }
        }
    }
    problems
}

/// GitHub's anchor for a heading: lower case, spaces to `-`, other punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings.
fn anchors(md: &str) -> BTreeSet<String> {
    let (prose, _) = split_fences(md);
    prose
        .iter()
        .filter_map(|(_, l)| l.strip_prefix('#'))
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

/// The repository's markdown files outside build, tool and history folders.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with('.')
            || name == "target"
            || path.ends_with(HISTORY_DIR.trim_end_matches('/'))
        {
            continue;
        }
        if path.is_dir() {
            markdown_files(&path, out);
        } else if name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// Links from `doc` (a file at `doc_path`, relative to the root) to `BENCHMARKS.md#anchor`
/// whose anchor is not a heading of `page`.
fn anchor_problems(doc_path: &str, doc: &str, page: &str) -> Vec<String> {
    let known = anchors(page);
    let mut problems = Vec::new();
    for (n, line) in doc.lines().enumerate() {
        for (at, _) in line.match_indices("BENCHMARKS.md#") {
            let anchor: String = line[at + "BENCHMARKS.md#".len()..]
                .chars()
                .take_while(|c| !matches!(c, ')' | ' ' | '`' | '"' | '>'))
                .collect();
            if !known.contains(&anchor) {
                problems.push(format!(
                    "{doc_path}:{}: BENCHMARKS.md has no heading #{anchor}",
                    n + 1
                ));
            }
        }
    }
    problems
}

fn page() -> String {
    std::fs::read_to_string(root().join("BENCHMARKS.md")).unwrap()
}

#[test]
fn every_figure_names_its_record() {
    let md = page();
    let tables = tables(&md);
    assert!(tables.len() >= 10, "only {} tables found", tables.len());
    let rows: usize = tables.iter().map(|t| t.rows.len()).sum();
    assert!(rows >= 50, "only {rows} figure rows found");
    let problems = record_problems(&md);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_command_on_the_page_exists() {
    let md = page();
    let cmds = commands(&md);
    for program in ["fission", "fission-loadtest", "cargo"] {
        assert!(
            cmds.iter().any(|c| c[0] == program),
            "no `{program}` command found on the page"
        );
    }
    assert!(cmds.iter().any(|c| is_script(&c[0])), "no script found");
    let mut helps = Helps {
        cache: HashMap::new(),
    };
    let problems = command_problems(&md, &root(), &mut helps);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Each distinct subcommand path really ran its `--help`.
    assert!(helps.cache.len() >= 5, "{:?}", helps.cache.keys());
}

#[test]
fn every_history_link_resolves_and_every_history_file_is_linked() {
    let md = page();
    assert!(
        md.contains("\n## History\n"),
        "the page has no History section"
    );
    assert!(
        history_links(&md).len() >= 30,
        "too few history links on the page"
    );
    let problems = history_problems(&md, &root());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn links_to_the_page_name_its_headings() {
    let md = page();
    let root = root();
    let mut docs = Vec::new();
    markdown_files(&root, &mut docs);
    assert!(docs.iter().any(|d| d.ends_with("loadtest/README.md")));
    let mut problems = Vec::new();
    for doc in docs {
        let shown = doc.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(&doc).unwrap();
        problems.extend(anchor_problems(&shown, &text, &md));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // And the check can fail.
    let bad = "see [it](../BENCHMARKS.md#kv-transfer-issue-3) and [that](BENCHMARKS.md#no-such)";
    assert_eq!(
        anchor_problems("x.md", bad, &md),
        vec!["x.md:1: BENCHMARKS.md has no heading #no-such".to_string()]
    );
}

/// A page with one fault of each kind, and one line of each kind that is right.
const BAD_PAGE: &str = "\
# Benchmarks

| figure | value | record |
|---|---:|---|
| good | 1.0× | `.bench/engine-20261128-125101/` |
| good too | 2.0× | [2026-11-21](benchmarks/history/2026-11-21-kv-transfer.md) |
| bad | 3.0× | the run of Tuesday |
| short | 4.0× |

| figure | value |
|---|---|
| no record column | 5 |

Reproduce: `fission bench engine --op-times`, `fission-loadtest --url http://x ttft --repeats 3`,
`ROUNDS=5 engine/benches/run_engine_bench.sh` and `cargo test -p deploy --test fault_suite`.
Wrong: `fission bench engin --op-times`, `fission bench engine --no-such-flag`, `fission
--version`, `fission-loadtest simulate --no-such-flag`, `ROUNDS=5 engine/benches/no_such.sh`,
`cargo test -p deploy --test no_such_test`, `cargo bench -p no-such-package`.

## History

- [gone](benchmarks/history/2026-01-01-no-such-section.md)
";

#[test]
fn the_checks_fail_on_a_bad_page() {
    let records = record_problems(BAD_PAGE);
    assert_eq!(records.len(), 3, "{records:#?}");
    assert!(records[0].contains("line 7") && records[0].contains("Tuesday"));
    assert!(records[1].contains("line 8") && records[1].contains("2 cells"));
    assert!(records[2].contains("line 10") && records[2].contains("without a `record`"));

    let mut helps = Helps {
        cache: HashMap::new(),
    };
    let cmd_problems = command_problems(BAD_PAGE, &root(), &mut helps);
    let expect = [
        "`fission bench engin --op-times`: names no subcommand of `fission bench`",
        "`fission bench engin --op-times`: --op-times is not in the help of `fission bench`",
        "`fission bench engine --no-such-flag`: --no-such-flag",
        "`fission --version`: names no subcommand",
        "`fission-loadtest simulate --no-such-flag`: --no-such-flag",
        "engine/benches/no_such.sh is not a file",
        "deploy has no --test no_such_test",
        "no package no-such-package",
    ];
    for e in expect {
        assert!(
            cmd_problems.iter().any(|p| p.contains(e)),
            "expected {e:?} among {cmd_problems:#?}"
        );
    }
    assert_eq!(cmd_problems.len(), expect.len(), "{cmd_problems:#?}");

    let history = history_problems(BAD_PAGE, &root());
    assert!(
        history
            .iter()
            .any(|p| p.contains("2026-01-01-no-such-section.md does not exist")),
        "{history:#?}"
    );
    // The real history files are not linked from this page.
    assert!(history.iter().any(|p| p.contains("is not linked")));
}

#[test]
fn a_command_group_and_its_subcommands_resolve() {
    let mut helps = Helps {
        cache: HashMap::new(),
    };
    let cmd = words("fission bench kvtransfer --tokens 1024");
    assert_eq!(
        cli_problems(&mut helps, Path::new(FISSION), &cmd),
        Vec::<String>::new()
    );
    assert!(helps.cache.contains_key(&(
        PathBuf::from(FISSION),
        vec!["bench".into(), "kvtransfer".into()]
    )));
    let cmd = words("fission bench kvtransfer --tokenz 1024");
    assert_eq!(cli_problems(&mut helps, Path::new(FISSION), &cmd).len(), 1);
}
