-- pgq compatibility, part 4: ticks.  Ticks are pgcascade's (pgcascade.make_tick); PgQ's
-- ticker() decides when one is due by PgQ's rules, so pgqd can tick a pgcascade database.

-- pgq.ticker(queue) -> the new tick's id, or null when the queue needs no tick yet: events
-- wait and neither ticker_max_count of them nor ticker_max_lag has been reached, or the queue
-- is idle and its ticks are spaced out (each idle interval up to twice the previous one,
-- up to ticker_idle_period).
create or replace function pgq.ticker(i_queue_name text) returns int8
language plpgsql security definer set search_path = pg_catalog as $$
declare
    q pgcascade.queue;
    v_seq int8;
    v_last pgcascade.tick;
    v_lag interval;
    v_prev_time timestamptz;
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name for update;
    if not found then
        raise exception 'no such queue';
    end if;
    if q.queue_external_ticker then
        raise exception 'This queue has external tick source.';
    end if;
    if q.queue_ticker_paused then
        raise exception 'Ticker has been paused for this queue';
    end if;
    v_seq := pgq.seq_getval(q.queue_event_seq::text);
    select * into v_last from pgcascade.tick where tick_queue = q.queue_id order by tick_id desc limit 1;
    if found then
        if pg_snapshot_xmin(v_last.tick_snapshot)::text::int8 > txid_current() then
            raise exception 'Invalid PgQ state: old xmin=%, old xmax=%, cur txid=%',
                pg_snapshot_xmin(v_last.tick_snapshot), pg_snapshot_xmax(v_last.tick_snapshot), txid_current();
        end if;
        if v_seq < v_last.tick_event_seq then
            raise warning 'Negative new_events?  old=% cur=%', v_last.tick_event_seq, v_seq;
        end if;
        if pg_snapshot_xmax(v_last.tick_snapshot)::text::int8 > txid_current() then
            raise warning 'Dubious PgQ state: old xmax=%, cur txid=%', pg_snapshot_xmax(v_last.tick_snapshot), txid_current();
        end if;
        v_lag := now() - v_last.tick_time;
        if v_seq > v_last.tick_event_seq then
            if v_seq - v_last.tick_event_seq < q.queue_ticker_max_count and v_lag < q.queue_ticker_max_lag then
                return null;
            end if;
        else
            select tick_time into v_prev_time from pgcascade.tick
             where tick_queue = q.queue_id and tick_id < v_last.tick_id order by tick_id desc limit 1;
            if found and (v_lag < q.queue_ticker_max_lag / 2
                          or (v_lag < (v_last.tick_time - v_prev_time) * 2 and v_lag < q.queue_ticker_idle_period)) then
                return null;
            end if;
        end if;
    end if;
    return pgcascade.make_tick(q, null, null, v_seq);
end $$;

-- pgq.ticker(queue, tick_id, time, event_seq) -> tick_id: a tick given from outside (a
-- cascade branch repeating its provider's), on a queue with external_ticker set.
create or replace function pgq.ticker(i_queue_name text, i_tick_id bigint, i_orig_timestamp timestamptz, i_event_seq bigint)
returns int8
language plpgsql security definer set search_path = pg_catalog as $$
begin
    perform 1 from pgcascade.queue
     where queue_name = i_queue_name and queue_external_ticker and not queue_ticker_paused;
    if not found then
        raise exception 'queue not found or ticker disabled: %', i_queue_name;
    end if;
    return pgcascade.branch_tick(i_queue_name, i_tick_id, i_orig_timestamp, i_event_seq);
end $$;

-- pgq.ticker() -> how many queues got a tick: every queue not paused nor ticked from outside.
create or replace function pgq.ticker() returns int8
language sql security definer set search_path = pg_catalog as $$
    select count(*) from (select pgq.ticker(queue_name) as t from pgcascade.queue
                           where not queue_external_ticker and not queue_ticker_paused
                           order by queue_name) x
     where x.t > 0
$$;

-- pgq.force_tick(queue) -> the queue's last tick id.  Moves the event sequence past
-- ticker_max_count, so the ticker's next round ticks whatever its thresholds.
create or replace function pgq.force_tick(i_queue_name text) returns int8
language plpgsql security definer set search_path = pg_catalog as $$
begin
    perform setval(queue_event_seq, nextval(queue_event_seq) + queue_ticker_max_count * 2 + 1000)
       from pgcascade.queue
      where queue_name = i_queue_name and not queue_external_ticker and not queue_ticker_paused;
    return (select t.tick_id from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue
             where q.queue_name = i_queue_name order by t.tick_id desc limit 1);
end $$;

-- pgq.find_tick_helper(queue_id, prev tick, its time, its event seq, min_count, min_interval)
-- -> the tick that closes a batch of at least min_count events or min_interval of time, when
-- the newest tick is that far: the newest tick when it is not more than twice as far, else
-- the first tick that is far enough.
create or replace function pgq.find_tick_helper(
    in i_queue_id int4, in i_prev_tick_id int8, in i_prev_tick_time timestamptz, in i_prev_tick_seq int8,
    in i_min_count int8, in i_min_interval interval,
    out next_tick_id int8, out next_tick_time timestamptz, out next_tick_seq int8)
language plpgsql stable as $$
declare
    t pgcascade.tick;
    v_far bool := false;
    v_enough bool := false;
begin
    select * into t from pgcascade.tick where tick_queue = i_queue_id and tick_id > i_prev_tick_id
     order by tick_id desc limit 1;
    if not found then
        return;
    end if;
    if i_min_count is not null then
        v_enough := t.tick_event_seq - i_prev_tick_seq >= i_min_count;
        v_far := t.tick_event_seq - i_prev_tick_seq > i_min_count * 2;
    end if;
    if i_min_interval is not null then
        v_enough := v_enough or t.tick_time - i_prev_tick_time >= i_min_interval;
        v_far := v_far or t.tick_time - i_prev_tick_time > i_min_interval * 2;
    end if;
    if v_far then
        select * into t from pgcascade.tick
         where tick_queue = i_queue_id and tick_id > i_prev_tick_id
           and ((i_min_count is not null and tick_event_seq - i_prev_tick_seq >= i_min_count)
                or (i_min_interval is not null and tick_time - i_prev_tick_time >= i_min_interval))
         order by tick_id limit 1;
        v_enough := true;
    end if;
    if v_enough then
        next_tick_id := t.tick_id;
        next_tick_time := t.tick_time;
        next_tick_seq := t.tick_event_seq;
    end if;
end $$;
