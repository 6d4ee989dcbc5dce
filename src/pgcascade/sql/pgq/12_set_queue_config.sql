-- pgcascade.set_queue_config(queue_name, param, value) -> 1.
-- Params (with or without the "queue_" prefix, as PgQ accepts): ticker_max_count,
-- ticker_max_lag, ticker_idle_period, ticker_paused, rotation_period, external_ticker,
-- disable_insert, ntables.
create or replace function pgcascade.set_queue_config(i_queue_name text, i_param text, i_value text) returns int4
language plpgsql as $$
declare
    q pgcascade.queue;
    p text := regexp_replace(lower(i_param), '^queue_', '');
begin
    q := pgcascade.find_queue(i_queue_name);
    case p
        when 'ticker_max_count' then update pgcascade.queue set queue_ticker_max_count = i_value::int4 where queue_id = q.queue_id;
        when 'ticker_max_lag' then update pgcascade.queue set queue_ticker_max_lag = i_value::interval where queue_id = q.queue_id;
        when 'ticker_idle_period' then update pgcascade.queue set queue_ticker_idle_period = i_value::interval where queue_id = q.queue_id;
        when 'ticker_paused' then update pgcascade.queue set queue_ticker_paused = i_value::bool where queue_id = q.queue_id;
        when 'rotation_period' then update pgcascade.queue set queue_rotation_period = i_value::interval where queue_id = q.queue_id;
        when 'external_ticker' then update pgcascade.queue set queue_external_ticker = i_value::bool where queue_id = q.queue_id;
        when 'disable_insert' then
            update pgcascade.queue set queue_disable_insert = i_value::bool where queue_id = q.queue_id;
            perform pgcascade.capture_refresh(i_queue_name);  -- the capture triggers follow at once
        when 'ntables' then
            if i_value::int4 < q.queue_ntables then
                raise exception 'ntables can only grow (queue "%" has %)', i_queue_name, q.queue_ntables using errcode = '22023';
            end if;
            update pgcascade.queue set queue_ntables = i_value::int4 where queue_id = q.queue_id;
            perform pgcascade.queue_ensure_parts(q.queue_id, i_value::int4);
        else
            raise exception 'unknown queue parameter "%"', i_param using errcode = '22023';
    end case;
    return 1;
end $$;
