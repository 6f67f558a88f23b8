//! Kernel-side budgets: what each of the observer's eBPF programs may cost per run (issue 19).
//!
//! Spec:
//! - Every program in `observer-ebpf` has one entry here (a test reads the programs' sources and
//!   fails on a program without one, or an entry without a program): its name, the event a run
//!   stands for, and its budget in ns per run, **net of the kernel's BPF statistics' own cost**
//!   (their two clock reads around every run; `cargo xtask bench storm` measures that cost as an
//!   empty program's ns per run under them and prints each program's net ns per run beside its
//!   budget).
//! - The rule the numbers come from: the observer's work on an event adds at most 10 % to what
//!   the event itself costs on the development VM (2 vCPUs, retpolines and Safe RET, so every
//!   kernel call and return is dear), with each event's cost in `basis`. The fault path's budget
//!   is the issue's: 100 ns a fault in all (10 % of a 1 µs fault, a 1M faults/s storm), the
//!   entry 55 and the memcg close 22 a run, which runs about twice a fault on cgroup v1.
//! - The kernel's dispatch of a hook (the raw tracepoint's call, the perf overflow path) is
//!   outside every budget: it is the same for any program there, including one that returns at
//!   once (`bench storm`'s floor, D).
//! - A program that times its event reads the clock once at least: about 55 ns a call on the
//!   development VM (an indirect call under retpolines, returns under Safe RET), more than the
//!   syscall programs' budget. `bench storm` prints them over; the budgets are not raised to fit.
//! - A program that does the work of two events is judged for each: `sys_enter` and `sys_exit`
//!   run for every syscall of the target (their budgets here, against a 4 KiB page-cache read,
//!   the cheapest I/O call), and on a read of the model they also charge it to its region
//!   (`xread`). That work is an explicit read of the model: it is judged against what such a read
//!   costs at least ([`XREAD_WORK`], the rule's 10 %), as `bench storm --kind
//!   pread` measures both (the work as B − C of the two programs per read of its 4 KiB storm, the
//!   event alone beside it). An engine that read the model 4 KiB at a time would pay the work
//!   against that smaller read; the bench prints the ratio to it too.
//! - Likewise `filemap_add` and `filemap_delete`: they run for every file's page (their budgets
//!   here, judged on another file's pages), and on the model's pages they also count them into
//!   the model's intervals and blame their eviction (`filemap`, `evict`). A model page that
//!   leaves the page cache and is used again comes back from storage: that work is judged per
//!   page against [`MODEL_PAGE_WORK`], as `bench storm --kind churn`
//!   measures both (the work as B − O of the two programs per page, the event as the run alone).
//! - Work added to a program later (a growing set of followed processes, eviction actors,
//!   histogram sums) stays within its budget, or the budget changes here with its reason.

/// Work a program does on one of the model's own events beside its own event's (module spec),
/// budgeted apart: at most `share` of `event`, which the bench times alone in the same run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ApartBudget {
    /// The work, and the programs that do it.
    pub work: &'static str,
    pub share: f64,
    /// The event the work stands for.
    pub event: &'static str,
}

impl ApartBudget {
    /// The budget in ns for an event that took `event_ns`.
    pub fn ns(&self, event_ns: f64) -> f64 {
        self.share * event_ns
    }
}

/// What `sys_enter` and `sys_exit` add on a read of the model (`observer_common::xread`), beyond
/// what they do on any syscall; timed by `bench storm --kind pread`.
pub const XREAD_WORK: ApartBudget = ApartBudget {
    work: "explicit-read work (sys_enter + sys_exit)",
    share: 0.10,
    event: "a page-cache read of the model's smallest routed-expert part (one expert's slice of one `ffn_*_exps` \
            tensor, widened to 4 KiB pages): the least an engine reads of the model for an expert",
};

/// What `filemap_add` and `filemap_delete` add on the model's own pages (`observer_common::filemap`,
/// `evict`), beyond what they do for any file's page, per page; timed by `bench storm --kind churn`.
pub const MODEL_PAGE_WORK: ApartBudget = ApartBudget {
    work: "page-cache work on the model (filemap_add + filemap_delete)",
    share: 0.10,
    event: "a page of the model leaving the page cache and entering it again, read back from storage",
};

/// One program's budget (module spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramBudget {
    /// The program's name (its function in `observer-ebpf`; the `bpf_programs` of a summary).
    pub program: &'static str,
    /// The event one run stands for.
    pub event: &'static str,
    /// At most this many ns per run, net of the statistics' own cost.
    pub ns_per_run: u32,
    /// Where the number comes from.
    pub basis: &'static str,
}

const FAULT: &str = "the fault path: 100 ns a fault (10 % of a 1 µs fault), entry 55 + close 22 × 2 (cgroup v1)";
const SYSCALL: &str =
    "10 % of a 4 KiB page-cache pread64 (0.9 µs here, `bench storm --kind pread` alone), for the pair";
const SWITCH: &str = "10 % of a context switch with its wakeup and runtime update: 2.5 µs here \
     (`taskset -c 0 perf bench sched pipe`: 5.0 µs an exchange, two switches), 250 ns for the four";
const TASK: &str = "10 % of the shortest thread's life, creation to exit (15 µs or more)";
const TOKEN: &str = "0.2 % of a 10 ms token (the demo's 100 tok/s); a mark copies every thread's state";
const BLOCK: &str = "10 % of a 4 KiB zram read (4 µs or more)";
const RECLAIM: &str = "10 % of a reclaim pass (10 µs or more)";
const PAGE_CACHE: &str = "10 % of a page-cache insertion or removal of any file's page (1 µs or more)";

/// Every program's budget (module spec), in the order of `observer-ebpf`'s modules.
pub const BUDGETS: &[ProgramBudget] = &[
    b("bio_queue", "a block I/O queued (any device)", 400, BLOCK),
    b("bio_complete", "a block I/O completed", 400, BLOCK),
    b("rq_complete", "a block request completed", 400, BLOCK),
    b("zram_rw_page", "a zram page read begins (Linux < 6.3)", 400, BLOCK),
    b("zram_rw_page_ret", "a zram page read ends (Linux < 6.3)", 400, BLOCK),
    b("evict_direct_begin", "direct reclaim begins", 1000, RECLAIM),
    b("evict_memcg_begin", "memcg reclaim begins", 1000, RECLAIM),
    b("evict_reclaim_end", "a reclaim pass ends", 1000, RECLAIM),
    b("fault_entry", "a fault (perf page-faults, where there are no raw entries)", 55, FAULT),
    b("fault_entry_user", "a user-mode fault", 55, FAULT),
    b(
        "fault_floor",
        "a fault hook (returns at once: `bench storm`'s floor)",
        5,
        "nothing: what is left is the statistics' noise",
    ),
    b("fault_entry_kernel", "a kernel-mode fault", 55, FAULT),
    b("fault_memcg", "a memcg event counted (PGFAULT, PGMAJFAULT, PGPGIN on cgroup v1, ...)", 22, FAULT),
    b("fault_exit_maj", "a major fault completes (perf major-faults)", 45, FAULT),
    b("fault_exit_min", "a minor fault completes (the perf close)", 45, FAULT),
    b(
        "filemap_fault",
        "a fault on a file mapping",
        100,
        "10 % of a file fault served from the page cache (1 µs or more)",
    ),
    b("filemap_add", "a page enters any file's page cache", 150, PAGE_CACHE),
    b("filemap_delete", "a page leaves any file's page cache", 150, PAGE_CACHE),
    b("mark_begin", "a token-marking call begins (uprobe)", 20_000, TOKEN),
    b("mark_end", "a token-marking call returns (uretprobe)", 20_000, TOKEN),
    b("call_begin", "a probed decode call begins (uprobe)", 2_000, TOKEN),
    b("call_end", "a probed decode call returns (uretprobe)", 2_000, TOKEN),
    b("reclaim_begin", "the target's thread begins reclaim", 1000, RECLAIM),
    b("reclaim_end", "the target's thread ends reclaim", 1000, RECLAIM),
    b("switch_raw", "a context switch (raw: the whole switch, where the kernel allows)", 160, SWITCH),
    b("switch_forget", "a context switch (raw: clears one word)", 10, SWITCH),
    b("sched_switch", "a context switch", 150, SWITCH),
    b("sched_runtime", "a runtime update (sched_stat_runtime)", 30, SWITCH),
    b("sched_wakeup", "a wakeup (sched_waking)", 60, SWITCH),
    b("runtime_raw", "a runtime update (raw sched_stat_runtime)", 30, SWITCH),
    b("waking_raw", "a wakeup (raw sched_waking)", 60, SWITCH),
    b(
        "task_rename",
        "a task is renamed (any process)",
        100,
        "10 % of a prctl(PR_SET_NAME) (1 µs or more with its tracepoint)",
    ),
    b("sched_exit", "a thread exits", 1500, TASK),
    b("process_free", "a process is freed", 1500, TASK),
    b("thread_free", "a task is freed (a tracked thread's slot is given back)", 1500, TASK),
    b("sched_exec", "a process execs", 50_000, "10 % of an exec (0.5 ms or more)"),
    b("new_task", "a thread or process is created", 1500, TASK),
    b("sys_enter", "a syscall enters (any process)", 45, SYSCALL),
    b("sys_exit", "a syscall returns (any process)", 45, SYSCALL),
];

const fn b(program: &'static str, event: &'static str, ns_per_run: u32, basis: &'static str) -> ProgramBudget {
    ProgramBudget { program, event, ns_per_run, basis }
}

/// The budget of program `name`.
pub fn budget(name: &str) -> Option<&'static ProgramBudget> {
    BUDGETS.iter().find(|b| b.program == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One entry per program, with a budget and its basis.
    #[test]
    fn each_program_has_one_budget() {
        for (i, b) in BUDGETS.iter().enumerate() {
            assert!(BUDGETS[..i].iter().all(|o| o.program != b.program), "{} twice", b.program);
            assert!(b.ns_per_run > 0 && !b.basis.is_empty(), "{b:?}");
            assert_eq!(budget(b.program), Some(b));
        }
        assert_eq!(budget("no_such_program"), None);
    }
}
