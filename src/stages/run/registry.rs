//! The stage registry: [`Stage`], the one type that knows every stage of the pipeline — its name, the
//! stages each method chains and in what order, each stage's input topic (decided by the chain alone),
//! its output tables, its consumer group, its builder and its embedded-default catch-up. The stages
//! themselves (`crate::stages::<stage>/`) never name the runner; this file is the runner's view of them.
//!
//! Adding a stage: its folder under `src/stages/` (its `NAME`, its `StageLogic` and `build`, its
//! `publish_pending`), the schema of any new output table (`src/schema/`), and one variant here. Every
//! match below is exhaustive, so a variant the registry does not yet handle does not compile.

use std::path::Path;

use crate::bus::{Bus, BusProducer};
use crate::config::PipelineConfig;
use crate::error::{Error, Result};
use crate::lake::Lake;
use crate::method::Method;
use crate::runtime::TaskCtl;
use crate::schema::{Checkpoint, DeadLetter, HintRecord, Interaction, Judgment, Sample, Signal, Table, TeacherLogprobs, TrainStep};
use crate::stages::{hint, judge, signals, teacher, train, StageRun, StageTask, SLOW_STAGE_MAX_POLL_INTERVAL_MS};

/// A stage of the pipeline: the four streaming stages of the chain and the trainer after them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// Next-state pairing: `interactions` → `signals` (docs/method.md §1).
    Signals,
    /// PRM votes: `signals` → `judgments` (§2).
    Judge,
    /// Hint votes: `judgments` or `signals` → `hints` (§3).
    Hint,
    /// Teacher log-probs and sample assembly: `judgments` or `hints` → `teacher_logprobs`, `samples` (§4–§5).
    Teacher,
    /// The trainer: `samples` → `train_steps`, `checkpoints` (§6).
    Train,
}

impl Stage {
    /// Every stage, in data-flow order (the order the chain and [`Stage::input`] rely on).
    pub const ALL: [Stage; 5] = [Stage::Signals, Stage::Judge, Stage::Hint, Stage::Teacher, Stage::Train];

    /// The stage's name (`signals`, `judge`, `hint`, `teacher`, `train`): its `--only` task name,
    /// metrics label, dead letters' `stage` and consumer-group suffix. Each stage's folder defines it.
    pub const fn name(self) -> &'static str {
        match self {
            Stage::Signals => signals::NAME,
            Stage::Judge => judge::NAME,
            Stage::Hint => hint::NAME,
            Stage::Teacher => teacher::NAME,
            Stage::Train => train::NAME,
        }
    }

    /// The stage called `name`, or None.
    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The tables (topics) the stage writes besides `dead_letters`, the table the next stage reads first.
    pub const fn outputs(self) -> &'static [&'static str] {
        match self {
            Stage::Signals => &[Signal::NAME],
            Stage::Judge => &[Judgment::NAME],
            Stage::Hint => &[HintRecord::NAME],
            Stage::Teacher => &[Sample::NAME, TeacherLogprobs::NAME],
            Stage::Train => &[TrainStep::NAME, Checkpoint::NAME],
        }
    }

    /// Whether the stage writes `table` (every stage writes `dead_letters`).
    pub fn writes(self, table: &str) -> bool {
        table == DeadLetter::NAME || self.outputs().contains(&table)
    }

    /// Whether `method` runs the stage: signals, teacher and the trainer always; the judge when the
    /// method has a binary reward, hints when it has an OPD term ([`Method::uses_judge`],
    /// [`Method::uses_hints`]).
    pub fn runs_in(self, method: Method) -> bool {
        match self {
            Stage::Signals | Stage::Teacher | Stage::Train => true,
            Stage::Judge => method.uses_judge(),
            Stage::Hint => method.uses_hints(),
        }
    }

    /// The streaming stages of `method`, in chain order (the trainer, which follows them, is not part
    /// of the chain): binary signals → judge → teacher; OPD signals → hint → teacher; combined
    /// signals → judge → hint → teacher.
    pub fn chain(method: Method) -> Vec<Stage> {
        Stage::ALL.into_iter().filter(|s| *s != Stage::Train && s.runs_in(method)).collect()
    }

    /// The table (topic) the stage reads under `method`: the first output of the nearest stage before
    /// it that `method` runs, `interactions` for the first. For a stage `method` does not run, that is
    /// what it would read if it were inserted into the chain (binary's hint stage would read `judgments`).
    pub fn input(self, method: Method) -> &'static str {
        let before = Stage::ALL.into_iter().take_while(|s| *s != self);
        match before.filter(|s| s.runs_in(method)).last() {
            Some(prev) => prev.outputs()[0],
            None => Interaction::NAME,
        }
    }

    /// The stage's consumer group for pipeline `pipeline` (with the bus's group prefix):
    /// `nextstate.<pipeline>.<name>`, the trainer's `nextstate.<pipeline>.trainer`.
    pub fn group(self, bus: &Bus, pipeline: &str) -> String {
        match self {
            Stage::Train => train::consumer_group(bus, pipeline),
            Stage::Signals | Stage::Judge | Stage::Hint | Stage::Teacher => bus.group(&format!("nextstate.{pipeline}.{}", self.name())),
        }
    }

    /// The consumer's `max.poll.interval.ms` (0: the bus's setting): the signals stage never blocks on
    /// a model; the others wait on models and endpoints ([`SLOW_STAGE_MAX_POLL_INTERVAL_MS`]), the
    /// trainer on optimizer steps ([`train::TRAINER_MAX_POLL_INTERVAL_MS`]).
    pub const fn max_poll_ms(self) -> u32 {
        match self {
            Stage::Signals => 0,
            Stage::Judge | Stage::Hint | Stage::Teacher => SLOW_STAGE_MAX_POLL_INTERVAL_MS,
            Stage::Train => train::TRAINER_MAX_POLL_INTERVAL_MS,
        }
    }

    /// Builds the task of a streaming stage for `cfg` (its consumer group, batch size and input from
    /// this registry).
    ///
    /// # Errors
    /// [`Error::Config`] for a bad stage configuration, and for [`Stage::Train`], which is started by
    /// [`train::run_train`] with its own options; model and cache loading errors.
    pub fn build(self, cfg: &PipelineConfig, bus: &Bus, lake: &Lake, ctl: TaskCtl) -> Result<StageTask> {
        let run = StageRun { group: self.group(bus, &cfg.name), batch: cfg.stage_batch, max_poll_ms: self.max_poll_ms() };
        let input = self.input(cfg.method);
        match self {
            Stage::Signals => Ok(signals::build(cfg, bus, run, ctl)),
            Stage::Judge => judge::build(cfg, bus, lake, run, ctl),
            Stage::Hint => hint::build(cfg, input, bus, lake, run, ctl),
            Stage::Teacher => teacher::build(cfg, input, bus, lake, run, ctl),
            Stage::Train => Err(Error::Config("the trainer is not a chain stage: start it with stages::train::run_train".into())),
        }
    }

    /// The embedded default's catch-up for the stage: re-publishes its pending input from `lake`
    /// (the trainer: its untrained samples, with its run folder `run_dir`). Returns the rows published.
    ///
    /// # Errors
    /// Lake and Kafka errors.
    pub async fn republish(self, lake: &Lake, producer: &BusProducer, cfg: &PipelineConfig, run_dir: &Path) -> Result<u64> {
        let input = self.input(cfg.method);
        match self {
            Stage::Signals => signals::publish_pending(lake, producer).await,
            Stage::Judge => judge::publish_pending(lake, producer, &cfg.name).await,
            Stage::Hint => hint::publish_pending(lake, producer, &cfg.name, input == Judgment::NAME).await,
            Stage::Teacher => teacher::publish_pending(lake, producer, &cfg.name, input == HintRecord::NAME).await,
            Stage::Train => train::republish_untrained(lake, producer, cfg, run_dir).await,
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_method_chains_its_stages_and_each_reads_the_output_before_it() {
        use Stage::*;
        assert_eq!(Stage::chain(Method::Binary), vec![Signals, Judge, Teacher]);
        assert_eq!(Stage::chain(Method::Opd), vec![Signals, Hint, Teacher]);
        assert_eq!(Stage::chain(Method::Combined), vec![Signals, Judge, Hint, Teacher]);
        let inputs = |m: Method| Stage::ALL.map(|s| s.input(m));
        assert_eq!(inputs(Method::Binary), ["interactions", "signals", "judgments", "judgments", "samples"]);
        assert_eq!(inputs(Method::Opd), ["interactions", "signals", "signals", "hints", "samples"]);
        assert_eq!(inputs(Method::Combined), ["interactions", "signals", "judgments", "hints", "samples"]);
    }

    #[test]
    fn names_round_trip_and_every_output_is_a_schema_table() {
        let tables: Vec<&str> = crate::schema::all_schemas().into_iter().map(|(n, _)| n).collect();
        for s in Stage::ALL {
            assert_eq!(Stage::from_name(s.name()), Some(s));
            assert_eq!(s.to_string(), s.name());
            for t in s.outputs() {
                assert!(tables.contains(t), "{s} writes {t}, not a schema table");
            }
            assert!(s.writes("dead_letters"));
        }
        assert_eq!(Stage::from_name("trainer"), None);
        assert!(Stage::Teacher.writes("teacher_logprobs") && !Stage::Teacher.writes("judgments"));
    }

    #[test]
    fn the_run_command_lists_every_stage_as_a_task_and_sinks_every_output() {
        let tasks = crate::stages::run::tasks();
        assert_eq!(tasks, ["serve", "proxy", "signals", "judge", "hint", "teacher", "train", "sinks", "reload"]);
        let sinks = crate::stages::run::sink_tables();
        assert_eq!(sinks, ["interactions", "signals", "judgments", "hints", "samples", "teacher_logprobs", "train_steps", "checkpoints", "dead_letters"]);
    }

    #[test]
    fn consumer_groups_are_the_documented_names() {
        let cfg = crate::bus::BusConfig { brokers: Some("127.0.0.1:1".into()), topic_prefix: "ns.".into(), ..Default::default() };
        let bus = Bus::connect_lazy(cfg).unwrap();
        let groups = Stage::ALL.map(|s| s.group(&bus, "p"));
        assert_eq!(groups, ["ns.nextstate.p.signals", "ns.nextstate.p.judge", "ns.nextstate.p.hint", "ns.nextstate.p.teacher", "ns.nextstate.p.trainer"]);
        assert_ne!(Stage::Signals.max_poll_ms(), Stage::Judge.max_poll_ms());
    }
}
