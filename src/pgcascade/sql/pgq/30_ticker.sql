-- pgcascade.tick_snapshot() -> pg_current_snapshot(), but with the calling transaction visible.
-- A snapshot never shows its own transaction as visible when its xid is at or past the
-- snapshot's xmax (xmax is the latest completed xid + 1).  Every xid from xmax up to our own
-- has not completed either, so listing them as in progress and moving xmax past our xid is
-- exact: it changes the visibility of our own transaction and nothing else.  `i_own_events`
-- false: the transaction inserted no event, and the snapshot is taken as it is (here, in a
-- statement of this function's own: the caller's INSERT's snapshot is older).
-- (a release before it had no i_own_events)
drop function if exists pgcascade.tick_snapshot();
create or replace function pgcascade.tick_snapshot(i_own_events bool default true) returns pg_snapshot
language plpgsql as $$
declare
    snap pg_snapshot := pg_current_snapshot();
    own xid8 := pg_current_xact_id_if_assigned();
    xmax int8 := pg_snapshot_xmax(snap)::text::int8;
    own_n int8 := own::text::int8;
    xs int8[];
    x int8;
begin
    if not i_own_events or own is null or own_n < xmax then
        return snap;
    end if;
    -- built without a query whose row estimate follows its parameters (one over
    -- generate_series(xmax, own_n - 1) was planned again at every tick)
    xs := array(select t::text::int8 from pg_snapshot_xip(snap) t);
    x := xmax;
    while x < own_n loop  -- (an integer FOR loop would be int4: xid8 values outgrow it)
        xs := xs || x;
        x := x + 1;
    end loop;
    return format('%s:%s:%s', pg_snapshot_xmin(snap), own_n + 1, array_to_string(xs, ','))::pg_snapshot;
end $$;

-- The functions a daemon calls at every batch or tick (ticker, tick_now, next_batch_events,
-- next_batch_custom, consumer_listens) run with enable_seqscan = off, for what they call too.
-- Their sessions keep their plans for their whole life, and a plan is made from the tables'
-- statistics of that moment: the tick table is small when a queue is new or idle (the ticker
-- VACUUMs it at its start, with one tick in it) and holds a thousand ticks a few seconds after
-- load begins. A plan made for one tick reads the table whole at each lookup (a fresh pair at
-- 500 tps: ~5 scans of ~640 ticks a fetch until autovacuum's ANALYZE, about a minute later,
-- made the plans again). Every lookup there has an index; small tables lose nothing by it.

-- pgcascade.make_tick(queue_id, tick_id, tick_time, event_seq) -> tick_id.
-- Records pg_current_snapshot() as the tick.  The caller holds the queue row lock, so ticks of
-- one queue are serialized and each snapshot is taken after the previous tick committed.
-- NOTIFY pgcascade_tick (payload: queue name) wakes consumers at commit instead of polling;
-- `i_notify` false: nobody is to be woken (next_batch_events' tick on demand where the queue
-- has no other consumer).
-- The tick counts its own transaction as committed (see tick_snapshot), so events inserted
-- in the same transaction as the tick - a cascade branch copying a batch - are in it;
-- `i_own_events` false: the caller's transaction inserted none, and the snapshot serves as it
-- is (next_batch_events: tick_snapshot's list of the ids between the snapshot's end and the
-- caller's own was 4 % of the fetch's instructions, bench/fetch_cpu.py).
-- (a release before it had no i_notify, then no i_own_events)
drop function if exists pgcascade.make_tick(pgcascade.queue, int8, timestamptz, int8);
drop function if exists pgcascade.make_tick(pgcascade.queue, int8, timestamptz, int8, bool);
create or replace function pgcascade.make_tick(
    q pgcascade.queue, i_tick_id int8, i_tick_time timestamptz, i_event_seq int8, i_notify bool default true,
    i_own_events bool default true)
returns int8
language plpgsql as $$
declare
    v_last int8;
    v_id int8;
begin
    -- a tick is durable before anyone can read it: its commit record follows the commit of
    -- every transaction in its snapshot, so those are flushed too, even where commits are
    -- asynchronous - a consumer never applies events that a crash could take back
    perform set_config('synchronous_commit', 'on', true);
    -- the newest tick by the index from its end: planned with a small table's statistics,
    -- max() became an aggregate over every tick of the queue (2 ms at 1,400 ticks)
    select tick_id into v_last from pgcascade.tick where tick_queue = q.queue_id order by tick_id desc limit 1;
    v_id := coalesce(i_tick_id, coalesce(v_last, 0) + 1);
    if v_id <= coalesce(v_last, 0) then
        raise exception 'tick % for queue "%" is not after its last tick %', v_id, q.queue_name, v_last
            using errcode = '22023';
    end if;
    insert into pgcascade.tick (tick_queue, tick_id, tick_time, tick_snapshot, tick_event_seq)
    values (q.queue_id, v_id, coalesce(i_tick_time, now()), pgcascade.tick_snapshot(i_own_events),
            coalesce(i_event_seq, pg_sequence_last_value(q.queue_event_seq), 0));
    if i_notify then
        perform pg_notify('pgcascade_tick', q.queue_name);
    end if;
    return v_id;
end $$;

-- pgcascade.ticker(queue_name) -> tick_id: make a tick now, whatever the thresholds.
create or replace function pgcascade.ticker(i_queue_name text) returns int8
language plpgsql set enable_seqscan = off as $$
declare
    q pgcascade.queue;
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name for update;
    if not found then
        perform pgcascade.find_queue(i_queue_name);
    end if;
    if q.queue_external_ticker then
        raise exception 'queue "%" takes its ticks from its provider (external_ticker)', i_queue_name
            using errcode = '55000';
    end if;
    return pgcascade.make_tick(q, null, null, null);
end $$;

-- pgcascade.ticker(queue_name, tick_id, tick_time, event_seq) -> tick_id: a tick with a given id.
-- Used by a cascade branch to repeat its provider's ticks; the id must follow the last one.
create or replace function pgcascade.ticker(i_queue_name text, i_tick_id int8, i_tick_time timestamptz, i_event_seq int8)
returns int8
language plpgsql set enable_seqscan = off as $$
declare
    q pgcascade.queue;
begin
    if i_tick_id is null then
        raise exception 'tick id must be given' using errcode = '22004';
    end if;
    select * into q from pgcascade.queue where queue_name = i_queue_name for update;
    if not found then
        perform pgcascade.find_queue(i_queue_name);
    end if;
    return pgcascade.make_tick(q, i_tick_id, i_tick_time, i_event_seq);
end $$;

-- pgcascade.ticker_round() -> (ticks made, seconds until a tick can next be due): the
-- ticker daemon's round - tick every queue that needs it, and say how long it may sleep.
-- A queue needs a tick when events wait and (their count >= ticker_max_count or the last
-- tick is older than ticker_max_lag), or when ticker_idle_period passed without a tick.
-- Events wait when numbered since the last tick, or committed since it by a transaction in
-- progress at it: such a transaction numbered its events before the tick (counted by it) and
-- commits them after; with nothing numbered since, it waited for the idle period (1 s).
-- No tick can be due before the last one is ticker_max_lag old (or ticker_idle_period, if
-- shorter), nor, while events wait, before their count reaches ticker_max_count at the pace
-- they came at: until then the daemon need not ask. A consumer that ticks on demand (a
-- worker, a logical capture daemon) keeps its queue's last tick recent, so the daemon asks
-- once per ticker_max_lag instead of every ticker_period; a queue whose last tick is older
-- than that is asked again at once (0: an event may come at any moment).
create or replace function pgcascade.ticker_round(out ticks int4, out due_in float8)
language plpgsql set enable_seqscan = off as $$
declare
    q pgcascade.queue;
    last_time timestamptz;
    last_seq int8;
    last_snap pg_snapshot;
    waiting int8;
    age float8;
    lag float8;
    due float8;
begin
    ticks := 0;
    for q in select * from pgcascade.queue
              where not queue_ticker_paused and not queue_external_ticker
              order by queue_id for update skip locked loop
        select tick_time, tick_event_seq, tick_snapshot into last_time, last_seq, last_snap
          from pgcascade.tick where tick_queue = q.queue_id order by tick_id desc limit 1;
        waiting := coalesce(pg_sequence_last_value(q.queue_event_seq), 0) - coalesce(last_seq, 0);
        if last_time is null
           or waiting >= q.queue_ticker_max_count
           or (waiting > 0 and now() - last_time >= q.queue_ticker_max_lag)
           or now() - last_time >= q.queue_ticker_idle_period
           or (waiting <= 0 and now() - last_time >= q.queue_ticker_max_lag
               and exists (select 1 from pg_snapshot_xip(last_snap))
               and pgcascade.events_committed_since(q.queue_id, last_snap)) then
            perform pgcascade.make_tick(q, null, null, null);
            ticks := ticks + 1;
            last_time := now();
            waiting := 0;
        end if;
        age := extract(epoch from now() - last_time);
        lag := extract(epoch from least(q.queue_ticker_max_lag, q.queue_ticker_idle_period));
        due := greatest(lag - age, 0);
        if waiting > 0 and age > 0 then
            due := least(due, age * (q.queue_ticker_max_count - waiting) / waiting);
        end if;
        due_in := least(due_in, due);
    end loop;
end $$;

-- pgcascade.ticker() -> number of ticks made: tick every queue that needs it (ticker_round).
create or replace function pgcascade.ticker() returns int4
language sql as $$ select ticks from pgcascade.ticker_round() $$;
