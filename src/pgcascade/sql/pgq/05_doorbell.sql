-- A queue's doorbell: how an idle consumer that makes its queue's ticks on demand
-- (next_batch_events) sleeps on LISTEN pgcascade_tick instead of polling, and is woken the
-- moment a change commits (one that keeps finding changes polls and rings nobody: worker.py).
--
-- The doorbell is a sequence per queue (migration 19) holding the time, in ms since the epoch,
-- until which some consumer listens.  The consumer sets it (consumer_listens) and only then
-- reads the queue's event sequence: events numbered before that are pending and it polls for
-- them; a producer numbers its events first and reads the doorbell after (ring_sql), so any
-- event it numbers after the consumer looked finds the doorbell set and its transaction
-- notifies at commit.  Sequences are not transactional: each side sees the other's write at
-- once, whatever its snapshot.  Nobody clears the doorbell: it runs out, so a consumer that
-- dies asleep costs producers a NOTIFY for at most its last wait, and two consumers never
-- clear each other's.  A producer notifies only while a consumer listens: under load consumers
-- poll, the doorbell runs out, and commits pay no NOTIFY (whose commit-time lock would
-- serialize them).

-- pgcascade.doorbell_name(queue_id) -> the qualified name of the queue's doorbell sequence.
create or replace function pgcascade.doorbell_name(i_queue_id int4) returns text
language sql immutable as $$ select format('pgcascade.%I', format('event_%s_wake_seq', i_queue_id)) $$;

-- pgcascade.ring_sql(queue) -> the PL/pgSQL statement with which a capture function, right after
-- it inserted its events (FOUND), notifies the queue's listening consumers; '' for a queue
-- without a doorbell (one created by a release before it, until the next install).  The
-- doorbell is read by pg_sequence_last_value of its OID, an expression PL/pgSQL evaluates
-- itself (NULL until a consumer first sets it: nobody listens), not by a query with an
-- executor of its own (SELECT last_value FROM it) at each statement of the application.  What
-- is left of the ring costs the writer ~7 us a statement (bench/capture_cpu.py without it);
-- the time is date_part's float, not extract's numeric (3 us less a statement, measured with
-- single-row UPDATEs each in its own transaction).
-- Every name in it is qualified: the capture functions run with their caller's search_path.
create or replace function pgcascade.ring_sql(q pgcascade.queue) returns text
language plpgsql stable as $$
declare
    bell regclass := to_regclass(pgcascade.doorbell_name(q.queue_id));
begin
    if bell is null then
        return '';
    end if;
    return format($r$
    if found and pg_catalog.pg_sequence_last_value(%s::pg_catalog.oid::pg_catalog.regclass) OPERATOR(pg_catalog.>)
                 (pg_catalog.date_part('epoch', pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000)::pg_catalog.int8 then
        perform pg_catalog.pg_notify('pgcascade_tick', %L);
    end if;$r$, bell::oid, q.queue_name);
end $$;

-- pgcascade.ring_doorbell(queue_id, wait_ms) -> false when the queue has no doorbell (one made
-- by a release before it): sets it to now + wait_ms (never lower), so producers numbering events
-- from now on notify.
create or replace function pgcascade.ring_doorbell(i_queue_id int4, i_wait_ms int8) returns bool
language plpgsql as $$
declare
    bell regclass := to_regclass(pgcascade.doorbell_name(i_queue_id));
    until_ms int8 := (extract(epoch from clock_timestamp()) * 1000)::int8 + i_wait_ms;
begin
    if bell is null then
        return false;
    end if;
    if coalesce(pg_sequence_last_value(bell), 0) < until_ms then
        perform setval(bell, until_ms);
    end if;
    return true;
end $$;

-- pgcascade.consumer_listens(queue, wait_ms, seen_event_seq) -> whether events may be pending:
-- numbered after `seen_event_seq` (the consumer's last tick's), committed or not, or numbered
-- before the queue's last tick by a transaction then in progress - still in progress (it rang
-- nobody: it numbered them before the doorbell was set) or committed since.  Sets the doorbell
-- to now + wait_ms first (never lower), so producers numbering events from now on notify; when
-- it returns false the caller may sleep on LISTEN for wait_ms.  A queue without a doorbell
-- answers true: its consumer polls.
create or replace function pgcascade.consumer_listens(i_queue_name text, i_wait_ms int8, i_seen_event_seq int8)
returns bool
language plpgsql set enable_seqscan = off as $$
declare
    q pgcascade.queue;
    last pgcascade.tick;
begin
    q := pgcascade.find_queue(i_queue_name);
    if not pgcascade.ring_doorbell(q.queue_id, i_wait_ms) then
        return true;
    end if;
    if coalesce(pg_sequence_last_value(q.queue_event_seq), 0) > coalesce(i_seen_event_seq, 0) then
        return true;
    end if;
    select * into last from pgcascade.tick where tick_queue = q.queue_id order by tick_id desc limit 1;
    return last.tick_id is not null
       and (exists (select 1 from pg_snapshot_xip(last.tick_snapshot) x where pg_xact_status(x) = 'in progress')
            or pgcascade.events_committed_since(q.queue_id, last.tick_snapshot));
end $$;
